"""The RL loop as a small typed core (core.py) over its parts (parts.py) and hooks (hooks.py,
metrics.py); slime.ray implements the parts over Ray actors."""
