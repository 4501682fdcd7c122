"""Drafter checkpoints in their official formats: a folder with `config.json` + `model.safetensors`.

    save_drafter(drafter, folder, dtype=torch.float16)
    load_drafter(folder, target_cfg, kind=None, dtype=torch.float32) -> Eagle3Drafter | DFlashDrafter | DSparkDrafter
    check_fits_target(drafter_cfg, target_cfg)            raises SpecrtError when it does not fit
    infer_kind(config_dict) -> "eagle3" | "dflash" | "dspark"

Formats (tensor names are the torch modules' state-dict names, which mirror the references):

- EAGLE-3 (SafeAILab/EAGLE `cnets.py`; vLLM/SGLang `llama_eagle3`): `fc.weight`,
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight`, `d2t` (int64), `t2d` (bool), optional `embed_tokens.weight`.
  config.json: `architectures: ["LlamaForCausalLMEagle3"]`, Llama keys, `num_hidden_layers: 1`,
  `draft_vocab_size`, `target_hidden_size`, and the taps as vLLM's
  `eagle_config.eagle_aux_hidden_state_layer_ids` (hidden_states indices; absent -> (2, L//2, L-3)).
  On load `model.` prefixes are stripped and SpecForge-style `layers.0.` is read as `midlayer.`.
- DFlash (z-lab/dflash, e.g. its test fixtures): `fc.weight`, `hidden_norm.weight`,
  `layers.N.{input_layernorm,post_attention_layernorm}.weight`,
  `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight`,
  `layers.N.mlp.{gate,up,down}_proj.weight`, `norm.weight` (no embedding / LM head: shared).
  config.json: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`, `num_target_layers`,
  `block_size`, and `dflash_config: {block_size, mask_token_id, target_layer_ids}` with z-lab's
  *layer* indices (hidden_states index - 1). Missing target_layer_ids fall back to z-lab's default
  (spread over as many taps as draft layers).
- DSpark (deepseek-ai/DeepSpec `Qwen3DSparkModel`): the DFlash backbone keys plus
  `markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`, `confidence_head.proj.weight`,
  `confidence_head.proj.bias` (+ `markov_head.gate_proj.*` / `markov_head.joint_proj.*` for the
  gated / GRU ("rnn") variants). config.json: `architectures: ["Qwen3DSparkModel"]`, top-level
  `target_layer_ids` (layer indices, -1 = embeddings), `mask_token_id`, `block_size` (gamma),
  `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`, and
  specrt's `sts_temperatures` (the calibration; official loaders ignore the extra key). DeepSpec's
  copies of the target's `embed_tokens`/`lm_head` are ignored on load and not written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import save_file

from specrt.export.checkpoints.hf import read_folder_weights, read_json
from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig, rope_from_hf
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter, dflash_target_layer_ids
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter, default_eagle3_taps

Drafter = Union[Eagle3Drafter, DFlashDrafter, DSparkDrafter]
DrafterConfig = Union[Eagle3Config, DFlashConfig, DSparkConfig]
KINDS = ("eagle3", "dflash", "dspark")

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "Qwen3DSparkModel"

_DTYPE_NAMES = {torch.float16: "float16", torch.float32: "float32", torch.bfloat16: "bfloat16"}
_SHARED_PREFIXES = ("embed_tokens.", "lm_head.")  # DeepSpec stores copies of the target's


def drafter_kind(drafter: Drafter | DrafterConfig) -> str:
    if isinstance(drafter, (DSparkDrafter, DSparkConfig)):
        return "dspark"
    if isinstance(drafter, (DFlashDrafter, DFlashConfig)):
        return "dflash"
    if isinstance(drafter, (Eagle3Drafter, Eagle3Config)):
        return "eagle3"
    raise TypeError(f"not a specrt drafter: {type(drafter).__name__}")


def infer_kind(hf: dict[str, Any], source: str = "config.json") -> str:
    """Drafter kind from config.json: architectures / model_type first, then telltale keys."""
    arch = " ".join(str(a) for a in (hf.get("architectures") or [])).lower()
    model_type = str(hf.get("model_type", "")).lower()
    names = f"{arch} {model_type}"
    if "dflash2" in names:
        raise SpecrtError(
            f"{source}: {hf.get('architectures')} (DFlash2: convolutions and a candidate selector) is not supported",
            "use a DFlash (DFlashDraftModel), DSpark or EAGLE-3 drafter",
        )
    if "dspark" in names or "markov_rank" in hf:
        return "dspark"
    if "dflash" in names or "dflash_config" in hf:
        return "dflash"
    if "eagle3" in names or "draft_vocab_size" in hf:
        return "eagle3"
    raise SpecrtError(
        f"{source}: cannot tell which drafter this is (architectures={hf.get('architectures')}, "
        f"model_type={hf.get('model_type')!r})",
        "pass the kind explicitly (eagle3, dflash or dspark), or use the config.json that came with the drafter",
    )


# -- config.json <-> config objects ---------------------------------------------------------------
def _common_hf(cfg: DrafterConfig, num_layers: int, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def config_to_hf(cfg: DrafterConfig, dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """The official-format config.json dict of a drafter config."""
    kind = drafter_kind(cfg)
    if kind == "eagle3":
        out = {"architectures": [EAGLE3_ARCH], "model_type": "llama"}
        out.update(_common_hf(cfg, 1, dtype))
        out.update(
            draft_vocab_size=cfg.draft_vocab_size,
            target_hidden_size=cfg.target_hidden_size,
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.tap_layers)},
        )
        return out
    layer_ids = cfg.target_layer_ids
    if kind == "dflash":
        out = {"architectures": [DFLASH_ARCH], "model_type": "qwen3", "attention_bias": False}
        out.update(_common_hf(cfg, cfg.num_layers, dtype))
        out.update(
            layer_types=["full_attention"] * cfg.num_layers,
            num_target_layers=cfg.num_target_layers,
            block_size=cfg.block_size,
            dflash_config={
                "block_size": cfg.block_size,
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": layer_ids,
            },
        )
        return out
    out = {"architectures": [DSPARK_ARCH], "model_type": "qwen3", "attention_bias": False}
    out.update(_common_hf(cfg, cfg.num_layers, dtype))
    out.update(
        layer_types=["full_attention"] * cfg.num_layers,
        num_target_layers=cfg.num_target_layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=layer_ids,
        enable_confidence_head=True,
        confidence_head_with_markov=cfg.confidence_with_markov,
        markov_rank=cfg.markov_rank,
        markov_head_type="rnn" if cfg.markov_variant == "gru" else cfg.markov_variant,
    )
    return out


def _require(hf: dict[str, Any], key: str, source: str) -> Any:
    if key not in hf or hf[key] is None:
        raise SpecrtError(f"{source} lacks the key '{key}'", "use the config.json that came with the drafter")
    return hf[key]


def _dims_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        heads = int(_require(hf, "num_attention_heads", source))
        rope_theta, rope_scaling = rope_from_hf(hf)
        return dict(
            hidden_size=int(_require(hf, "hidden_size", source)),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or 0),
            intermediate_size=int(_require(hf, "intermediate_size", source)),
            vocab_size=int(_require(hf, "vocab_size", source)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        )
    except (TypeError, ValueError) as err:
        raise SpecrtError(
            f"{source} has a malformed value ({err})", "use the config.json that came with the drafter"
        ) from None


def _refuse_unsupported_backbone(hf: dict[str, Any], source: str) -> None:
    if hf.get("attention_bias"):
        raise SpecrtError(f"{source}: attention_bias=true is not supported for DFlash/DSpark drafters",
                          "use a drafter without attention biases (the official ones have none)")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise SpecrtError(f"{source}: sliding-window drafter layers ({hf.get('layer_types')}) are not supported",
                          "use a drafter whose layers are all full_attention")
    extra = hf.get("dflash_config") or {}
    if float(extra.get("output_multiplier", 1.0)) != 1.0 or extra.get("final_logit_softcapping"):
        raise SpecrtError(f"{source}: output_multiplier / final_logit_softcapping are not supported",
                          "use a DFlash drafter without logit scaling")


def config_from_hf(
    hf: dict[str, Any], kind: str, target_cfg: LlamaConfig, tensor_names: set[str] | None = None,
    source: str = "config.json",
) -> DrafterConfig:
    """Build the drafter config of `kind` from an official config.json dict."""
    dims = _dims_from_hf(hf, source)
    if kind == "eagle3":
        layers = int(hf.get("num_hidden_layers", 1))
        if layers != 1:
            raise SpecrtError(
                f"{source}: EAGLE-3 drafter with {layers} layers; specrt supports the official one-layer drafter",
                "use a one-layer EAGLE-3 checkpoint",
            )
        taps = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_eagle3_taps(
            target_cfg.num_layers
        )
        return Eagle3Config(
            **dims,
            draft_vocab_size=int(hf.get("draft_vocab_size") or dims["vocab_size"]),
            target_hidden_size=int(hf.get("target_hidden_size") or dims["hidden_size"]),
            tap_layers=list(taps),
            own_embedding=bool(tensor_names and "embed_tokens.weight" in tensor_names),
        )
    _refuse_unsupported_backbone(hf, source)
    extra = hf.get("dflash_config") or {}

    def value(name: str, default: Any = None) -> Any:
        return extra.get(name, hf.get(name, default))

    num_layers = int(_require(hf, "num_hidden_layers", source))
    num_target_layers = int(hf.get("num_target_layers") or target_cfg.num_layers)
    layer_ids = value("target_layer_ids")
    if layer_ids is None:
        layer_ids = dflash_target_layer_ids(num_target_layers, num_layers)  # z-lab's fallback
    mask = value("mask_token_id")
    if mask is None:
        raise SpecrtError(f"{source} lacks mask_token_id", "use the config.json that came with the drafter")
    common = dict(
        **dims,
        num_layers=num_layers,
        tap_layers=[int(i) + 1 for i in layer_ids],
        mask_token_id=int(mask),
        num_target_layers=num_target_layers,
    )
    if kind == "dflash":
        return DFlashConfig(**common, block_size=int(value("block_size", 16)))
    if hf.get("enable_confidence_head") is False:
        raise SpecrtError(f"{source}: this DSpark drafter was trained without a confidence head",
                          "use a DSpark checkpoint with enable_confidence_head=true (specrt schedules by confidence)")
    cfg = DSparkConfig(
        **common,
        block_size=int(value("block_size", 7)),
        markov_rank=int(hf.get("markov_rank", 256)),
        markov_variant=str(hf.get("markov_head_type", "vanilla")),
        confidence_with_markov=bool(hf.get("confidence_head_with_markov", True)),
    )
    return cfg


# -- fit against the target ---------------------------------------------------------------------
def check_fits_target(drafter_cfg: DrafterConfig, target_cfg: LlamaConfig) -> None:
    """Refuse a drafter whose widths, vocabulary or taps do not fit this target."""
    kind = drafter_kind(drafter_cfg)
    name = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}[kind]
    fix = "use the drafter trained for this target model"
    if drafter_cfg.vocab_size != target_cfg.vocab_size:
        what = "t2d covers" if kind == "eagle3" else "vocab_size is"
        raise SpecrtError(
            f"{name} drafter vocab mismatch: its {what} {drafter_cfg.vocab_size} tokens, "
            f"the target's vocab_size is {target_cfg.vocab_size}",
            fix,
        )
    if drafter_cfg.target_hidden_size != target_cfg.hidden_size:
        raise SpecrtError(
            f"{name} drafter hidden size mismatch: it reads target features of width "
            f"{drafter_cfg.target_hidden_size}, the target's hidden_size is {target_cfg.hidden_size}",
            fix,
        )
    shares_embedding = kind != "eagle3" or not drafter_cfg.own_embedding
    if shares_embedding and drafter_cfg.hidden_size != target_cfg.hidden_size:
        raise SpecrtError(
            f"{name} drafter hidden size mismatch: hidden_size {drafter_cfg.hidden_size} cannot use the "
            f"target's embedding{'' if kind == 'eagle3' else ' and LM head'} of width {target_cfg.hidden_size}",
            fix,
        )
    taps = list(drafter_cfg.tap_layers)
    if kind == "eagle3" and len(taps) != 3:
        raise SpecrtError(f"EAGLE-3 drafter taps {taps}: it needs exactly 3 tap layers", fix)
    if not taps:
        raise SpecrtError(f"{name} drafter has no tap layers", fix)
    bad = [i for i in taps if not 0 <= i <= target_cfg.num_layers]
    if bad:
        raise SpecrtError(
            f"{name} drafter tap layers {taps} (hidden_states indices) do not fit: {bad} beyond the "
            f"target's {target_cfg.num_layers} layers (hidden_states[0..{target_cfg.num_layers}])",
            fix,
        )
    if kind != "eagle3" and not 0 <= drafter_cfg.mask_token_id < target_cfg.vocab_size:
        raise SpecrtError(
            f"{name} drafter mask_token_id {drafter_cfg.mask_token_id} is outside the target vocabulary "
            f"(0..{target_cfg.vocab_size - 1})",
            fix,
        )


def build_drafter(cfg: DrafterConfig) -> Drafter:
    kind = drafter_kind(cfg)
    return {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter, "dspark": DSparkDrafter}[kind](cfg)


# -- save / load ---------------------------------------------------------------------------------
def save_drafter(drafter: Drafter, folder: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write `config.json` + `model.safetensors` in the drafter's official format; returns the folder."""
    if dtype not in _DTYPE_NAMES:
        raise SpecrtError(f"cannot save a drafter as {dtype}", "use torch.float16, torch.bfloat16 or torch.float32")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    hf = config_to_hf(cfg, dtype)
    state = drafter.state_dict()
    if isinstance(drafter, DSparkDrafter):
        hf["sts_temperatures"] = [float(t) for t in state.pop("sts_temperatures")]
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous().clone()
        for name, t in state.items()
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return folder


def _normalise_names(tensors: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if kind == "eagle3" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        if kind != "eagle3" and name.startswith(_SHARED_PREFIXES):
            continue  # the target's embedding / LM head: shared, never loaded from the drafter
        out[name] = tensor
    return out


def load_drafter(
    folder: str | Path, target_cfg: LlamaConfig, kind: str | None = None, dtype: torch.dtype = torch.float32
) -> Drafter:
    """Load an official-format drafter folder for `target_cfg` (eval mode, not yet bound to the target).

    After loading: EAGLE-3 -> `bind_target_embedding(target.embed_tokens)` unless it has its own;
    DFlash/DSpark -> `bind_target(target.embed_tokens, target.lm_head)`.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecrtError(
            f"drafter folder not found: {folder}",
            "pass the folder holding the drafter's config.json and model.safetensors",
        )
    config_path = folder / "config.json"
    hf = read_json(config_path, "drafter config")
    if not isinstance(hf, dict):
        raise SpecrtError(
            f"drafter config {config_path} is not a JSON object", "the file is corrupt: download it again"
        )
    if kind is None:
        kind = infer_kind(hf, str(config_path))
    elif kind not in KINDS:
        raise SpecrtError(f"unknown drafter kind {kind!r}", f"use one of {', '.join(KINDS)}")
    tensors = _normalise_names(read_folder_weights(folder), kind)
    cfg = config_from_hf(hf, kind, target_cfg, set(tensors), str(config_path))
    check_fits_target(cfg, target_cfg)
    drafter = build_drafter(cfg)
    expected = drafter.state_dict()
    if isinstance(drafter, DSparkDrafter):
        expected.pop("sts_temperatures")
        temps = hf.get("sts_temperatures")
        if temps is not None:
            if len(temps) != cfg.block_size:
                raise SpecrtError(
                    f"{config_path}: {len(temps)} sts_temperatures for a block of {cfg.block_size}",
                    "recalibrate the drafter, or drop sts_temperatures to use none",
                )
            drafter.sts_temperatures.copy_(torch.tensor([float(t) for t in temps]))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise SpecrtError(
            f"{folder}: the {kind} drafter weights lack {len(missing)} tensors (first: {missing[0]})",
            "the weights do not match config.json or are not a complete drafter checkpoint",
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SpecrtError(
            f"{folder}: unexpected tensors for a {kind} drafter (first: {unexpected[0]})",
            "this checkpoint is a different drafter architecture: check the kind and config.json",
        )
    for name, tensor in expected.items():
        if tuple(tensors[name].shape) != tuple(tensor.shape):
            raise SpecrtError(
                f"{folder}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {tuple(tensor.shape)}",
                "the weights and config.json come from different drafters",
            )
    drafter.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    return drafter.to(dtype).eval()


__all__ = [
    "save_drafter", "load_drafter", "check_fits_target", "infer_kind", "drafter_kind", "config_to_hf",
    "config_from_hf", "build_drafter", "KINDS",
]
