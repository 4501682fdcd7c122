"""Drafter checkpoints in their official formats: a folder with `config.json` + `model.safetensors`.

    save_drafter(drafter, folder, dtype=torch.float16)
    load_drafter(folder, target_cfg, kind=None, dtype=torch.float32) -> Eagle3Drafter | DFlashDrafter | DSparkDrafter
    read_drafter_checkpoint(folder, target_cfg, kind=None) -> DrafterCheckpoint   (what `inspect-drafter` shows)
    check_fits_target(drafter_cfg, target_cfg)            raises SpecrtError when it does not fit
    infer_kind(config_dict) -> "eagle3" | "dflash" | "dspark"

Which format a folder is comes from its config.json fields and tensor names
(`specrt.export.checkpoints.drafter_formats`, which also holds the rule for every config field: read,
inert, or refused). A load says in one line what it detected; the drafter config records the format
(`checkpoint_format`) and, for block drafters, the label convention (`convention`), and both reach the
engine manifest with the rest of the config. docs/drafter-formats.md is the user-facing list.

Formats (tensor names are the torch modules' state-dict names, which mirror the references):

- EAGLE-3 (SafeAILab/EAGLE `cnets.py`; vLLM/SGLang `llama_eagle3`; vLLM speculators): `fc.weight`,
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight`, `d2t` (int64), `t2d` (bool) unless draft_vocab_size == vocab_size
  (the reference drops them: ids map 1:1), optional `embed_tokens.weight`.
  config.json: `architectures: ["LlamaForCausalLMEagle3"]`, Llama keys, `num_hidden_layers: 1`,
  `draft_vocab_size`, `target_hidden_size` (only when it differs from hidden_size: SafeAILab's loader
  reads the target's embedding only without it), the taps as `eagle_config.eagle_aux_hidden_state_layer_ids`
  or the top-level `eagle_aux_hidden_state_layer_ids` (hidden_states indices; absent -> (2, L//2, L-3)),
  `norm_before_residual`. speculators nests the Llama keys in `transformer_layer_config`.
  On load `model.` prefixes are stripped, SpecForge/speculators `layers.0.` is read as `midlayer.`,
  and RoPE buffers (`...rotary_emb.inv_freq`) are dropped with a note.
- DFlash (z-lab/dflash): `fc.weight`, `hidden_norm.weight`,
  `layers.N.{input_layernorm,post_attention_layernorm}.weight`,
  `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight`,
  `layers.N.mlp.{gate,up,down}_proj.weight`, `norm.weight` (no embedding / LM head: shared).
  config.json: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`, `num_target_layers`,
  `block_size`, and `dflash_config: {block_size, mask_token_id, target_layer_ids}` with z-lab's
  *layer* indices (hidden_states index - 1). Missing target_layer_ids fall back to z-lab's old default
  (spread over as many taps as draft layers). Block index k predicts p+k.
- DeepSpec DFlash mode (deepseek-ai/DeepSpec's published DFlash drafters): DeepSpec's DSpark model
  with `markov_rank: 0` and `enable_confidence_head: false`; the DFlash backbone keys. Block index k
  predicts p+k+1 (`DFlashConfig.convention = "deepspec"`), so B inputs give B drafts.
- DSpark (deepseek-ai/DeepSpec `Qwen3DSparkModel`): the DFlash backbone keys plus
  `markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`, `confidence_head.proj.weight`,
  `confidence_head.proj.bias` (+ `markov_head.gate_proj.*` / `markov_head.joint_proj.*` for the
  gated / GRU ("rnn") variants). config.json: `architectures: ["Qwen3DSparkModel"]`, top-level
  `target_layer_ids` (layer indices, -1 = embeddings), `mask_token_id`, `block_size` (gamma),
  `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
  `num_anchors` (training only; DeepSpec's constructor requires it), and specrt's `sts_temperatures`
  (the calibration; official loaders ignore the extra key). DeepSpec's copies of the target's
  `embed_tokens`/`lm_head` are ignored on load and not written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import torch
from safetensors.torch import save_file

from specrt.export.checkpoints.drafter_formats import (
    DrafterFormat, detect_format, flat_eagle3_config, review_fields,
)
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
# buffers a raw save of the reference trainers carries that are not weights (recomputed from the config)
_NON_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq", "rotary_emb.cos_cached",
                        "rotary_emb.sin_cached")
_EAGLE3_TRAINING_COPIES = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators' training targets
DEEPSPEC_NUM_ANCHORS = 512  # the value of DeepSpec's published configs; only training reads it
_FIX_CONFIG = "use the config.json that came with the drafter"


def drafter_kind(drafter: Drafter | DrafterConfig) -> str:
    if isinstance(drafter, (DSparkDrafter, DSparkConfig)):
        return "dspark"
    if isinstance(drafter, (DFlashDrafter, DFlashConfig)):
        return "dflash"
    if isinstance(drafter, (Eagle3Drafter, Eagle3Config)):
        return "eagle3"
    raise TypeError(f"not a specrt drafter: {type(drafter).__name__}")


def infer_kind(hf: dict[str, Any], source: str = "config.json") -> str:
    """Drafter kind from config.json alone (`detect_format` also reads tensor names)."""
    return detect_format(hf, None, None, source)[0].kind


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


def _deepspec_hf(cfg: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    out = {"architectures": [DSPARK_ARCH], "model_type": "qwen3", "attention_bias": False}
    out.update(_common_hf(cfg, cfg.num_layers, dtype))
    out.update(
        layer_types=["full_attention"] * cfg.num_layers,
        num_target_layers=cfg.num_target_layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=cfg.target_layer_ids,
        num_anchors=DEEPSPEC_NUM_ANCHORS,  # DeepSpec's model constructor requires the (training) field
    )
    return out


def config_to_hf(cfg: DrafterConfig, dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """The official-format config.json dict of a drafter config (the format its convention implies)."""
    kind = drafter_kind(cfg)
    if kind == "eagle3":
        out = {"architectures": [EAGLE3_ARCH], "model_type": "llama"}
        out.update(_common_hf(cfg, 1, dtype))
        out.update(draft_vocab_size=cfg.draft_vocab_size)
        if cfg.target_hidden_size != cfg.hidden_size:
            # SafeAILab's loader reads the target's embedding only when this key is absent: write it only
            # when it differs (then the drafter carries its own embed_tokens.weight)
            out.update(target_hidden_size=cfg.target_hidden_size)
        if cfg.norm_before_residual:
            out.update(norm_before_residual=True)
        out.update(eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.tap_layers)})
        return out
    if kind == "dflash" and cfg.convention == "z-lab":
        out = {"architectures": [DFLASH_ARCH], "model_type": "qwen3", "attention_bias": False}
        out.update(_common_hf(cfg, cfg.num_layers, dtype))
        out.update(
            layer_types=["full_attention"] * cfg.num_layers,
            num_target_layers=cfg.num_target_layers,
            block_size=cfg.block_size,
            dflash_config={
                "block_size": cfg.block_size,
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": cfg.target_layer_ids,
            },
        )
        return out
    out = _deepspec_hf(cfg, dtype)
    if kind == "dflash":  # DeepSpec's DFlash mode: its DSpark model without the heads
        out.update(enable_confidence_head=False, markov_rank=0)
        return out
    out.update(
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


def _eagle3_taps(hf: dict[str, Any], target_cfg: LlamaConfig, source: str) -> list[int]:
    """vLLM reads the taps at the top level or nested in eagle_config; both name hidden_states indices."""
    top = hf.get("eagle_aux_hidden_state_layer_ids")
    nested = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is not None and nested is not None and list(top) != list(nested):
        raise SpecrtError(
            f"{source}: eagle_aux_hidden_state_layer_ids {list(top)} and eagle_config's {list(nested)} disagree",
            "keep one of them (the taps the drafter was trained on)",
        )
    taps = top if top is not None else nested
    return [int(i) for i in taps] if taps is not None else default_eagle3_taps(target_cfg.num_layers)


def config_from_hf(
    hf: dict[str, Any], kind: str | None, target_cfg: LlamaConfig, tensor_names: set[str] | None = None,
    source: str = "config.json", fmt: DrafterFormat | None = None,
) -> DrafterConfig:
    """Build the drafter config from an official config.json dict (`fmt` as `detect_format` finds it)."""
    if fmt is None:
        fmt = detect_format(hf, tensor_names, kind, source)[0]
    if fmt.kind == "eagle3":
        flat = flat_eagle3_config(hf)
        dims = _dims_from_hf(flat, source)
        layers = int(flat.get("num_hidden_layers", 1))
        if layers != 1:
            raise SpecrtError(
                f"{source}: EAGLE-3 drafter with {layers} layers; specrt supports the official one-layer drafter",
                "use a one-layer EAGLE-3 checkpoint",
            )
        return Eagle3Config(
            **dims,
            draft_vocab_size=int(flat.get("draft_vocab_size") or dims["vocab_size"]),
            target_hidden_size=int(flat.get("target_hidden_size") or dims["hidden_size"]),
            tap_layers=_eagle3_taps(flat, target_cfg, source),
            own_embedding=bool(tensor_names and "embed_tokens.weight" in tensor_names),
            norm_before_residual=bool(flat.get("norm_before_residual", False)),
            checkpoint_format=fmt.key,
        )
    dims = _dims_from_hf(hf, source)
    extra = hf.get("dflash_config") or {}

    def value(name: str, default: Any = None) -> Any:
        return extra.get(name, hf.get(name, default))

    num_layers = int(_require(hf, "num_hidden_layers", source))
    num_target_layers = int(hf.get("num_target_layers") or target_cfg.num_layers)
    layer_ids = value("target_layer_ids")
    if layer_ids is None:
        if fmt.convention != "z-lab":
            raise SpecrtError(f"{source} lacks target_layer_ids", _FIX_CONFIG)
        layer_ids = dflash_target_layer_ids(num_target_layers, num_layers)  # z-lab's old fallback
    mask = value("mask_token_id")
    if mask is None:
        raise SpecrtError(f"{source} lacks mask_token_id", _FIX_CONFIG)
    common = dict(
        **dims,
        num_layers=num_layers,
        tap_layers=[int(i) + 1 for i in layer_ids],
        mask_token_id=int(mask),
        num_target_layers=num_target_layers,
        checkpoint_format=fmt.key,
    )
    if fmt.kind == "dflash":
        default_block = 16 if fmt.convention == "z-lab" else 7
        return DFlashConfig(**common, block_size=int(value("block_size", default_block)), convention=fmt.convention)
    return DSparkConfig(
        **common,
        block_size=int(value("block_size", 7)),
        markov_rank=int(hf.get("markov_rank", 256)),
        markov_variant=str(hf.get("markov_head_type", "vanilla")),
        confidence_with_markov=bool(hf.get("confidence_head_with_markov", True)),
    )


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
    if kind == "dflash" and drafter_cfg.convention == "z-lab" and target_cfg.num_layers in taps:
        raise SpecrtError(
            f"DFlash drafter taps {taps} include hidden_states[{target_cfg.num_layers}], the target's last layer: "
            "z-lab's DFlash reads it after the target's final norm (transformers' hidden_states[-1]), while "
            "specrt's target taps are raw layer outputs, so the drafter would see other features",
            "use a drafter whose target_layer_ids stop before the last layer (z-lab's defaults end at L-3)",
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
def _identity_vocab_map(drafter: Eagle3Drafter) -> bool:
    return not bool(drafter.d2t.any()) and bool(drafter.t2d.all())


def save_drafter(drafter: Drafter, folder: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write `config.json` + `model.safetensors` in the drafter's official format; returns the folder.

    The files are what the reference code loads: an EAGLE-3 drafter with the full vocabulary has no
    d2t/t2d (SafeAILab deletes them), one that shares the target's embedding writes no
    `target_hidden_size` (SafeAILab then reads the target's embedding), a DeepSpec-convention DFlash
    drafter is written as DeepSpec's DSpark model without heads."""
    if dtype not in _DTYPE_NAMES:
        raise SpecrtError(f"cannot save a drafter as {dtype}", "use torch.float16, torch.bfloat16 or torch.float32")
    folder = Path(folder)
    cfg = drafter.config
    hf = config_to_hf(cfg, dtype)
    state = drafter.state_dict()
    if isinstance(drafter, DSparkDrafter):
        hf["sts_temperatures"] = [float(t) for t in state.pop("sts_temperatures")]
    if isinstance(drafter, Eagle3Drafter) and cfg.draft_vocab_size == cfg.vocab_size:
        if not _identity_vocab_map(drafter):
            raise SpecrtError(
                "this EAGLE-3 drafter has the full vocabulary but a d2t/t2d that is not the identity; the "
                "official format drops d2t/t2d when draft_vocab_size == vocab_size, so the reference code "
                "would read other tokens",
                "use a draft_vocab_size smaller than the vocabulary, or the identity map",
            )
        state.pop("d2t")
        state.pop("t2d")
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous().clone()
        for name, t in state.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return folder


@dataclass
class DrafterCheckpoint:
    """A drafter folder read and checked, before any module holds its weights."""

    folder: Path
    format: DrafterFormat
    evidence: str  # the config fields / tensor names that decided the format
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]  # exactly the drafter's state-dict entries
    ignored_fields: list[tuple[str, str]]  # (config field, why it does not change the computation)
    ignored_tensors: list[tuple[str, str]]  # (tensor name, why)
    sts_temperatures: list[float] | None = None

    @property
    def detected(self) -> str:
        """The one line a load prints."""
        cfg = self.config
        parts = [f"taps {list(cfg.tap_layers)}"]
        if isinstance(cfg, Eagle3Config):
            parts.append(f"draft vocab {cfg.draft_vocab_size}/{cfg.vocab_size}")
            if cfg.norm_before_residual:
                parts.append("norm_before_residual")
        else:
            parts.append(f"block {cfg.block_size}, {cfg.block_size - 1 + cfg.label_shift} drafts "
                         f"(index k predicts p+k{'+1' if cfg.label_shift else ''})")
        return f"{self.folder}: detected {self.format.name} [{self.evidence}]: " + ", ".join(parts)


def _ignorable(name: str, fmt: DrafterFormat) -> str | None:
    """Why a checkpoint tensor that is not a drafter weight can be dropped; None: it cannot."""
    if name.endswith(_NON_WEIGHT_SUFFIXES):
        return "RoPE buffer: recomputed from rope_theta / rope_scaling"
    if fmt.kind != "eagle3" and name.startswith(_SHARED_PREFIXES):
        return "DeepSpec's frozen copy of the target's embedding / LM head: the target's own is used"
    if fmt.kind == "eagle3" and name in _EAGLE3_TRAINING_COPIES:
        return "training-only copy of the target's norm / LM head"
    return None


def _normalise_names(tensors: dict[str, torch.Tensor], fmt: DrafterFormat) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if fmt.kind == "eagle3" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]  # SpecForge / speculators layer name
        out[name] = tensor
    return out


def read_drafter_checkpoint(folder: str | Path, target_cfg: LlamaConfig, kind: str | None = None) -> DrafterCheckpoint:
    """Read, detect and check a drafter folder: format, every config field, every tensor name and shape.

    Refuses what specrt would compute differently from the reference; does not check the target fit
    (`check_fits_target`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecrtError(
            f"drafter folder not found: {folder}",
            "pass the folder holding the drafter's config.json and model.safetensors",
        )
    if kind is not None and kind not in KINDS:
        raise SpecrtError(f"unknown drafter kind {kind!r}", f"use one of {', '.join(KINDS)}")
    config_path = folder / "config.json"
    source = str(config_path)
    hf = read_json(config_path, "drafter config")
    if not isinstance(hf, dict):
        raise SpecrtError(f"drafter config {config_path} is not a JSON object", "the file is corrupt: download it again")
    raw = read_folder_weights(folder)
    fmt, evidence = detect_format(hf, set(raw), kind, source)
    ignored_fields = review_fields(hf, fmt, source)
    tensors = _normalise_names(raw, fmt)
    ignored_tensors = []
    for name in sorted(tensors):
        why = _ignorable(name, fmt)
        if why is not None:
            ignored_tensors.append((name, why))
            del tensors[name]
    cfg = config_from_hf(hf, fmt.kind, target_cfg, set(tensors), source, fmt)
    with torch.device("meta"):  # names and shapes only: no memory for a large vocabulary
        expected = build_drafter(cfg).state_dict()
    if isinstance(cfg, DSparkConfig):
        expected.pop("sts_temperatures")
    if isinstance(cfg, Eagle3Config) and cfg.draft_vocab_size == cfg.vocab_size:
        # the reference drops d2t/t2d for a full-vocabulary drafter (draft id == target id), and ignores
        # them when a file carries them anyway
        for name in ("d2t", "t2d"):
            expected.pop(name)
            if name in tensors:
                ignored_tensors.append((name, "draft_vocab_size == vocab_size: the reference maps ids 1:1"))
                del tensors[name]
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise SpecrtError(
            f"{folder}: the {fmt.name} drafter weights lack {len(missing)} tensors (first: {missing[0]})",
            "the weights do not match config.json or are not a complete drafter checkpoint",
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SpecrtError(
            f"{folder}: unexpected tensors for a {fmt.name} drafter (first: {unexpected[0]})",
            "this checkpoint is a different drafter architecture or variant: check the kind and config.json",
        )
    for name, tensor in expected.items():
        if tuple(tensors[name].shape) != tuple(tensor.shape):
            raise SpecrtError(
                f"{folder}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {tuple(tensor.shape)}",
                "the weights and config.json come from different drafters",
            )
    temps = hf.get("sts_temperatures")
    if temps is not None:
        if not isinstance(cfg, DSparkConfig) or len(temps) != cfg.block_size:
            raise SpecrtError(
                f"{source}: {len(temps)} sts_temperatures for a block of {cfg.block_size}",
                "recalibrate the drafter, or drop sts_temperatures to use none",
            )
        temps = [float(t) for t in temps]
    return DrafterCheckpoint(folder, fmt, evidence, cfg, tensors, ignored_fields, ignored_tensors, temps)


def _print_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_drafter(
    folder: str | Path, target_cfg: LlamaConfig, kind: str | None = None, dtype: torch.dtype = torch.float32,
    say: Callable[[str], None] | None = _print_stderr,
) -> Drafter:
    """Load an official-format drafter folder for `target_cfg` (eval mode, not yet bound to the target).

    Says (stderr by default) one line naming the detected format, and one naming the tensors it
    ignored, if any. After loading: EAGLE-3 -> `bind_target_embedding(target.embed_tokens)` unless it
    has its own; DFlash/DSpark -> `bind_target(target.embed_tokens, target.lm_head)`.
    """
    ckpt = read_drafter_checkpoint(folder, target_cfg, kind)
    check_fits_target(ckpt.config, target_cfg)
    if say is not None:
        say(ckpt.detected)
        if ckpt.ignored_tensors:
            names = ", ".join(name for name, _ in ckpt.ignored_tensors)
            say(f"{ckpt.folder}: ignored {len(ckpt.ignored_tensors)} tensors that are not drafter weights ({names}); "
                "`specrt inspect-drafter` says why")
    drafter = build_drafter(ckpt.config)
    if ckpt.sts_temperatures is not None:
        drafter.sts_temperatures.copy_(torch.tensor(ckpt.sts_temperatures))
    drafter.load_state_dict(ckpt.tensors, strict=False)
    return drafter.to(dtype).eval()


__all__ = [
    "save_drafter", "load_drafter", "read_drafter_checkpoint", "DrafterCheckpoint", "check_fits_target",
    "infer_kind", "drafter_kind", "config_to_hf", "config_from_hf", "build_drafter", "KINDS",
]
