"""Optional extensions: reward functions, generate functions, model adapters."""
