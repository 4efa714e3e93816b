"""The engine: the step loop that composes scheduler, model runner and speculator (LLMEngine)."""
