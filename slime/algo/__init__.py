"""slime.algo package."""
