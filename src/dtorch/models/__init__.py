"""Models written once in global view that run under any parallel layout."""
from .llama import LlamaForCausalLM, LlamaModel  # noqa: F401
