"""slime.bridge package."""
