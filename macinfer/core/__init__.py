"""The engine's parts (vLLM v1's `core`): sequences and sampling, the block pool and prefix
cache, the scheduler, the model runner. Nothing here knows about speculation or the step loop."""
