"""slime.rollout package."""
