"""prime-async: asynchronous RL trainer for LLMs."""
