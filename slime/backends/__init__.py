"""slime.backends package."""
