"""Export-ready torch models: the Llama-family target (and, with issue 3, the drafters)."""

from specrt.export.models.config import LlamaConfig
from specrt.export.models.llama import LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
