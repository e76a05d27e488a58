"""slime's TIS functions at the path slime's scripts give `--custom-tis-function-path`
(slime.backends.megatron_utils.loss.icepop_function, ...). The math is slime.algo.tis_functions';
nothing here imports megatron, so the path resolves with the CPU install alone."""

from __future__ import annotations

from slime.algo.tis_functions import icepop_function, vanilla_tis_function

__all__ = ["icepop_function", "vanilla_tis_function"]
