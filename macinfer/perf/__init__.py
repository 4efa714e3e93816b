"""Performance figures: memory bandwidth, the benchmark harness, the KV-cache calculator."""
