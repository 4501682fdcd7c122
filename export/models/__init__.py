"""Export-ready torch models: the Llama-family target (`llama`) and the drafters (`eagle3`, `dflash`, `dspark`)."""

from specrt.export.models.config import LlamaConfig
from specrt.export.models.llama import LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
