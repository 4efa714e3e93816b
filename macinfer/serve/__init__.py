"""The OpenAI-compatible server: the async engine wrapper, the FastAPI app, Prometheus metrics."""
