"""slime.tools package."""
