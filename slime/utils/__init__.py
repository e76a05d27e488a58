"""slime.utils package."""
