"""What a run records about itself beyond its metrics, at slime's paths: per-sample traces
(`trace_utils`)."""
