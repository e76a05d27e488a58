"""slime.config package."""
