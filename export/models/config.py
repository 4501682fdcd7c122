"""Architecture description of a Llama-family target, independent of the checkpoint format.

`LlamaConfig` is what the torch model, the exporter and the manifest agree on. It is built from an
HF `config.json` (`from_hf_dict`) or from GGUF metadata (see `specrt.export.checkpoints.gguf`).
Architectures outside the family (mixture-of-experts, sliding-window-only models, ...) are refused
here, once, with a message that says what is supported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specrt.plugins.errors import SpecrtError

# model_type -> the switches that distinguish it inside the family
SUPPORTED_MODEL_TYPES = {
    "llama": dict(attention_bias=False, qk_norm=False),
    "mistral": dict(attention_bias=False, qk_norm=False),
    "qwen2": dict(attention_bias=True, qk_norm=False),
    "qwen3": dict(attention_bias=False, qk_norm=True),
}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) of a config.json, old style or transformers >= 5's rope_parameters."""
    rope_scaling = hf.get("rope_scaling") or None
    rope_theta = hf.get("rope_theta")
    if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
        params = dict(hf["rope_parameters"])
        rope_theta = params.pop("rope_theta", None)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    return float(rope_theta if rope_theta is not None else 10000.0), rope_scaling


def fill_attention_dims(cfg: Any, owner: str, fix: str) -> None:
    """The attention dims every config (target and drafters) settles in `__post_init__`: head_dim
    defaults to hidden_size // num_heads, and grouped-query attention needs whole groups."""
    if not cfg.head_dim:
        cfg.head_dim = cfg.hidden_size // cfg.num_heads
    if cfg.num_heads % cfg.num_kv_heads:
        raise SpecrtError(
            f"{owner}: num_attention_heads ({cfg.num_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_kv_heads})",
            fix,
        )


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        fill_attention_dims(self, "target config",
                            "check the checkpoint's config.json; grouped-query attention needs whole groups")

    @property
    def num_hidden_states(self) -> int:
        """hidden_states[0] is the embedding output, hidden_states[i] the output of layer i-1."""
        return self.num_layers + 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LlamaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> "LlamaConfig":
        """Translate a transformers config.json; refuse what the Llama family cannot express."""
        model_type = hf.get("model_type", "")
        moe = [k for k in _MOE_KEYS if hf.get(k)]
        if moe:
            raise SpecrtError(
                f"{source}: model_type '{model_type}' is a mixture-of-experts model ({moe[0]}="
                f"{hf[moe[0]]}); specrt supports dense Llama-family models only",
                f"use a dense model ({', '.join(sorted(SUPPORTED_MODEL_TYPES))})",
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise SpecrtError(
                f"{source}: unsupported architecture model_type='{model_type}' "
                f"(architectures={hf.get('architectures')})",
                f"specrt supports {', '.join(sorted(SUPPORTED_MODEL_TYPES))}",
            )
        switches = dict(SUPPORTED_MODEL_TYPES[model_type])
        if "attention_bias" in hf:
            switches["attention_bias"] = bool(hf["attention_bias"])
        try:
            eos = hf.get("eos_token_id")
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            rope_theta, rope_scaling = rope_from_hf(hf)
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=int(hf["num_attention_heads"]),
                num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
                head_dim=int(hf.get("head_dim") or 0),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                model_type=model_type,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **switches,
            )
        except KeyError as missing:
            raise SpecrtError(
                f"{source} lacks the key {missing}", "use the config.json that came with the checkpoint"
            ) from None
