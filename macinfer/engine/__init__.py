"""The engine: requests, sequences, the block pool and prefix cache, the scheduler, the model runner, the step loop."""
