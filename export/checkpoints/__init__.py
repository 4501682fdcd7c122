"""Checkpoint loading: one entry point, `load_target`, for HF folders, GGUF files and the default."""

from specrt.export.checkpoints.target import LoadedTarget, load_target

__all__ = ["LoadedTarget", "load_target"]
