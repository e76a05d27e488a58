"""`from slime.utils.types import Sample`, as slime's plugins write it (slime.utils.sample)."""

from slime.utils.sample import Sample

__all__ = ["Sample"]
