"""vtllm: an LLM serving engine — frontend, engine core and workers as separate processes."""

__version__ = "0.1.0"
