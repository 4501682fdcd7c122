"""Load a Llama-family target from a Hugging Face folder: config.json + safetensors (single or sharded).

Only the `safetensors` package is used to read weights; no transformers modeling code runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig
from specrt.export.models.llama import LlamaModel


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise SpecrtError(f"{what} not found: {path}", f"check the path; the folder needs {path.name}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecrtError(f"{what} {path} is not valid JSON ({err})", "the file is corrupt: download it again") from None


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise SpecrtError(f"weight file missing: {path}", "download the complete checkpoint (every shard)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise SpecrtError(
            f"weight file {path} is truncated or corrupt ({err})", "download the checkpoint file again"
        ) from None


def read_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, following model.safetensors.index.json when sharded."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index, "shard index")["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_safetensors(folder / shard))
        return tensors
    single = folder / "model.safetensors"
    if not single.exists():
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(found) == 1:
            single = folder / found[0]
        else:
            raise SpecrtError(
                f"no model.safetensors or model.safetensors.index.json in {folder}",
                "point at a Hugging Face checkpoint folder with safetensors weights "
                "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))",
            )
    return load_safetensors(single)


def strip_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names are model.layers.N...; ours drop the leading 'model.'."""
    out = {}
    for name, tensor in tensors.items():
        out[name[len("model."):] if name.startswith("model.") else name] = tensor
    return out


def load_state_into(model: LlamaModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into the model, with one clear error for missing or misshapen tensors."""
    cfg = model.config
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise SpecrtError(
            f"{source} lacks {len(missing)} tensors the config needs (first: {missing[0]})",
            "the weights do not match config.json, or a shard is missing: use the complete checkpoint",
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise SpecrtError(
                f"{source}: tensor {name} has shape {tuple(state[name].shape)}, the config says {tuple(tensor.shape)}",
                "the weights and config.json come from different models",
            )
    model.load_state_dict({k: state[k] for k in expected}, strict=False)


def load_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecrtError(f"checkpoint folder not found: {folder}", "pass an existing Hugging Face model folder or a .gguf file")
    cfg = LlamaConfig.from_hf_dict(read_json(folder / "config.json", "model config"), str(folder / "config.json"))
    state = {k: v.to(dtype) for k, v in strip_prefix(read_folder_weights(folder)).items()}
    model = LlamaModel(cfg).to(dtype)
    load_state_into(model, state, str(folder))
    return model.eval()
