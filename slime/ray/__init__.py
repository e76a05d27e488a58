"""slime.ray package."""
