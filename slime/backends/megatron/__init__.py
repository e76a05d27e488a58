"""The megatron-core train backend (issue 9). `convert` is pure tensor code and needs no
megatron-core; the rest imports megatron-core lazily."""
