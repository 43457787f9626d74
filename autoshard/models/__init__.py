"""Built-in models: a nanoGPT-style GPT used by the demo, the tests and the benchmarks."""
from autoshard.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
