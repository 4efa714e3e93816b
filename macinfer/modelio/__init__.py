"""Models in and out: loading, the embedded default, GGUF import, quantisation and evaluation."""
