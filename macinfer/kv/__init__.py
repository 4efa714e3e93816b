"""The paged KV cache as mlx-lm's models see it: the cache adapter, paged attention (reference and Metal), quantised K/V, RoPE."""
