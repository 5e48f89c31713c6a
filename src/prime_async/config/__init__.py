"""Config schemas (pydantic only; never imports torch)."""
