"""The model: a Llama-family decoder that reads and writes the paged KV cache."""

from .llama import LlamaModel, AttentionMetadata  # noqa: F401
from .loader import load_model, random_model_config  # noqa: F401
