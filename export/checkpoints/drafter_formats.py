"""Which official drafter format a checkpoint is, and what every field of its config.json does.

    detect_format(hf, tensor_names, kind=None, source) -> (DrafterFormat, evidence)
    review_fields(hf, fmt, source) -> [(field, why it is ignored)]   refuses fields that would change the math
    flat_eagle3_config(hf) -> dict                                     speculators' nested layout, flattened

Formats (docs/drafter-formats.md has the user-facing table):

- EAGLE3: SafeAILab/EAGLE, vLLM and SGLang (`LlamaForCausalLMEagle3`, Llama keys + `draft_vocab_size`;
  taps as `eagle_config.eagle_aux_hidden_state_layer_ids` or the top-level key of that name).
- EAGLE3_SPECULATORS: vLLM's speculators (`speculators_model_type: "eagle3"`, the layer dims nested in
  `transformer_layer_config`, `norm_before_residual`).
- DFLASH_ZLAB: z-lab/dflash (`DFlashDraftModel`, `dflash_config`): block index k predicts p+k, and a tap
  on the target's last layer is transformers' hidden_states[-1], i.e. after the final norm.
- DFLASH_DEEPSPEC: deepseek-ai/DeepSpec's DFlash-mode drafters: its `Qwen3DSparkModel` with
  `markov_rank: 0` and `enable_confidence_head: false`; index k predicts p+k+1, taps are the raw
  outputs of the target's layers (forward hooks).
- DSPARK: DeepSpec's DSpark (`Qwen3DSparkModel`, Markov rank > 0, confidence head).

The field rule (all formats): a field is read (USED), known not to change what the drafter computes
(inert, listed with the reason), or supported only at the values specrt computes exactly (others are
refused with a SpecrtError). A field none of the tables knows is refused too: specrt cannot vouch that
it is inert, and ignoring a field that matters would keep the output exact but silently wreck the
acceptance rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specrt.plugins.errors import SpecrtError


@dataclass(frozen=True)
class DrafterFormat:
    key: str  # short id, recorded in the manifest as the drafter config's checkpoint_format
    kind: str  # eagle3 | dflash | dspark
    name: str  # for people
    convention: str  # block drafters: "z-lab" | "deepspec" (DFlashConfig.convention); EAGLE-3: "eagle3"


EAGLE3 = DrafterFormat("eagle3", "eagle3", "EAGLE-3 (SafeAILab / vLLM / SGLang layout)", "eagle3")
EAGLE3_SPECULATORS = DrafterFormat("eagle3-speculators", "eagle3", "EAGLE-3 (vLLM speculators layout)", "eagle3")
DFLASH_ZLAB = DrafterFormat("dflash-zlab", "dflash", "z-lab DFlash", "z-lab")
DFLASH_DEEPSPEC = DrafterFormat("dflash-deepspec", "dflash",
                                "DeepSpec DFlash (DSpark model without Markov and confidence heads)", "deepspec")
DSPARK = DrafterFormat("dspark-deepspec", "dspark", "DeepSpec DSpark", "deepspec")
FORMATS = (EAGLE3, EAGLE3_SPECULATORS, DFLASH_ZLAB, DFLASH_DEEPSPEC, DSPARK)

_FIX_CONFIG = "use the config.json that came with the drafter"


# -- detection ------------------------------------------------------------------------------------
def _names(hf: dict[str, Any]) -> str:
    arch = " ".join(str(a) for a in (hf.get("architectures") or []))
    return f"{arch} {hf.get('model_type', '')} {hf.get('speculators_model_type', '')}".lower()


def _deepspec_format(hf: dict[str, Any], tensor_names: set[str], source: str) -> tuple[DrafterFormat, str]:
    has_markov_weights = any(n.startswith(("markov_head.", "model.markov_head.")) for n in tensor_names)
    has_conf_weights = any(n.startswith(("confidence_head.", "model.confidence_head.")) for n in tensor_names)
    # absent fields: the tensors say; without tensors (config alone), DSpark's defaults
    markov = hf.get("markov_rank")
    markov = int(markov) if markov is not None else (256 if has_markov_weights or not tensor_names else 0)
    conf = hf.get("enable_confidence_head")
    conf = bool(conf) if conf is not None else (has_conf_weights or not tensor_names)
    if markov == 0 and not conf:
        return DFLASH_DEEPSPEC, "Qwen3DSparkModel with markov_rank 0 and enable_confidence_head false"
    if markov > 0 and conf:
        return DSPARK, f"Qwen3DSparkModel with markov_rank {markov} and a confidence head"
    if markov > 0:
        raise SpecrtError(
            f"{source}: a DSpark drafter without a confidence head (markov_rank {markov}, "
            "enable_confidence_head false) is not supported: specrt's DSpark truncates drafts by confidence",
            "use a DSpark checkpoint trained with a confidence head, or a DFlash-mode one (markov_rank 0)",
        )
    raise SpecrtError(
        f"{source}: a DSpark drafter with a confidence head but no Markov head (markov_rank 0) is not supported",
        "use a DSpark checkpoint with markov_rank > 0, or a DFlash-mode one (no confidence head either)",
    )


def detect_format(
    hf: dict[str, Any], tensor_names: set[str] | None = None, kind: str | None = None, source: str = "config.json"
) -> tuple[DrafterFormat, str]:
    """The checkpoint's format from config.json fields first, then tensor names; (format, evidence).

    `kind` (what the user asked for) must agree with what the checkpoint says it is."""
    names, tensors = _names(hf), set(tensor_names or ())
    if "dflash2" in names:
        raise SpecrtError(
            f"{source}: {hf.get('architectures')} (DFlash2: convolutions and a candidate selector) is not supported",
            "use a DFlash (DFlashDraftModel), DSpark or EAGLE-3 drafter",
        )
    found: tuple[DrafterFormat, str] | None = None
    if "speculators_model_type" in hf:
        if str(hf["speculators_model_type"]).lower() != "eagle3":
            raise SpecrtError(f"{source}: speculators model type {hf['speculators_model_type']!r} is not supported",
                              "use an eagle3 speculators checkpoint, or a DFlash / DSpark drafter")
        found = EAGLE3_SPECULATORS, "speculators_model_type eagle3"
    elif "dspark" in names or "markov_rank" in hf or "enable_confidence_head" in hf:
        found = _deepspec_format(hf, tensors, source)
    elif "dflash" in names or "dflash_config" in hf:
        found = DFLASH_ZLAB, "DFlashDraftModel / dflash_config"
    elif "eagle3" in names or any(k in hf for k in ("draft_vocab_size", "eagle_config",
                                                       "eagle_aux_hidden_state_layer_ids")):
        found = EAGLE3, "LlamaForCausalLMEagle3 / draft_vocab_size"
    elif tensors:
        stripped = {n[len("model."):] if n.startswith("model.") else n for n in tensors}
        if any(n.startswith("midlayer.") for n in stripped) or {"d2t", "t2d"} & stripped:
            found = EAGLE3, "tensor names midlayer.* / d2t"
        elif any(n.startswith("markov_head.") for n in stripped):
            found = DSPARK, "tensor names markov_head.*"
    if found is None:
        block = kind in ("dflash", None) and any(".self_attn.q_norm." in n for n in tensors)
        what = (" (DFlash-style weights, but neither z-lab's dflash_config nor DeepSpec's markov_rank says "
                "whose block convention: index k predicting p+k or p+k+1)") if block else ""
        if kind == "eagle3":
            return EAGLE3, "kind given"
        if kind == "dspark":
            return DSPARK, "kind given"
        raise SpecrtError(
            f"{source}: cannot tell which drafter this is (architectures={hf.get('architectures')}, "
            f"model_type={hf.get('model_type')!r}){what}",
            "use the config.json that came with the drafter (it names the architecture), or pass the kind "
            "(eagle3, dflash or dspark) for an EAGLE-3 or DSpark checkpoint",
        )
    fmt, evidence = found
    if kind is not None and kind != fmt.kind:
        raise SpecrtError(
            f"{source}: this is a {fmt.name} checkpoint ({evidence}), not a {kind} drafter",
            f"use --drafter {fmt.kind} (kind={fmt.kind!r}) for it, or the {kind} checkpoint you meant",
        )
    return fmt, evidence


def flat_eagle3_config(hf: dict[str, Any]) -> dict[str, Any]:
    """speculators keeps the layer's dims in `transformer_layer_config`: lift them beside the top-level keys."""
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return dict(hf)
    return {**layer, **{k: v for k, v in hf.items() if k != "transformer_layer_config"}}


# -- the field tables -------------------------------------------------------------------------------
@dataclass(frozen=True)
class FieldRule:
    what: str  # what the field does (USED) or why it does not change the computation (inert)
    inert: bool = False
    supported: Callable[[Any], bool] | None = None  # values specrt computes exactly; others are refused
    requirement: str = ""  # the supported values, in words


def used(what: str, supported: Callable[[Any], bool] | None = None, requirement: str = "") -> FieldRule:
    return FieldRule(what, False, supported, requirement)


def inert(why: str) -> FieldRule:
    return FieldRule(why, True)


def _falsy(v: Any) -> bool:
    return not v


def _one(v: Any) -> bool:
    return v is None or float(v) == 1.0


def _all_full(v: Any) -> bool:
    return all(t == "full_attention" for t in (v or []))


_METADATA = "metadata about how the file was written"

# every Llama / Qwen3-style config (the drafter layers' dims, as transformers writes them)
COMMON_FIELDS: dict[str, FieldRule] = {
    "architectures": used("names the drafter format (detection)"),
    "model_type": used("names the layer family; the format fixes the drafter's layers"),
    "hidden_size": used("drafter width"),
    "intermediate_size": used("MLP width"),
    "num_attention_heads": used("query heads"),
    "num_key_value_heads": used("key/value heads (grouped-query attention)"),
    "head_dim": used("per-head width (default hidden_size // num_attention_heads)"),
    "num_hidden_layers": used("drafter layers (EAGLE-3: exactly 1)"),
    "rms_norm_eps": used("RMSNorm epsilon"),
    "rope_theta": used("RoPE base"),
    "rope_scaling": used("RoPE scaling (llama3 and linear are supported; others are refused when the drafter is built)"),
    "rope_parameters": used("transformers >= 5 form of rope_theta + rope_scaling"),
    "max_position_embeddings": used("longest position the drafter's RoPE table covers"),
    "vocab_size": used("the target vocabulary (must equal the target's)"),
    "hidden_act": used("MLP activation", lambda v: v in (None, "silu"), "silu"),
    "attention_bias": used("biases on q/k/v/o", _falsy, "false (the official drafters have none)"),
    "mlp_bias": used("biases in the MLP", _falsy, "false"),
    "layer_types": used("attention type per layer", _all_full, "all full_attention"),
    "use_sliding_window": used("sliding-window attention", _falsy, "false"),
    "sliding_window": inert("window of sliding_attention layers; every layer here is full_attention"),
    "max_window_layers": inert("how many layers use the sliding window; sliding windows are off"),
    "quantization_config": used("quantized weights", lambda v: v is None, "absent (specrt quantizes at export)"),
    "torch_dtype": inert("storage dtype of the weights; specrt computes in the export dtype"),
    "dtype": inert("storage dtype of the weights; specrt computes in the export dtype"),
    "transformers_version": inert(_METADATA),
    "_name_or_path": inert(_METADATA),
    "auto_map": inert("remote-code class names for transformers; specrt runs its own implementation"),
    "bos_token_id": inert("tokenizer ids: the drafter reads tokens, it does not treat these specially"),
    "eos_token_id": inert("tokenizer ids: stopping follows the target's eos ids"),
    "pad_token_id": inert("padding row of the embedding; only affects training gradients"),
    "initializer_range": inert("weight initialisation for training"),
    "use_cache": inert("transformers' cache switch; specrt always keeps its own KV cache"),
    "attention_dropout": inert("dropout: off at inference"),
    "pretraining_tp": inert("tensor-parallel slicing of the same matmuls (same result)"),
    "tie_word_embeddings": inert("drafters keep their own LM head (EAGLE-3) or use the target's (DFlash/DSpark)"),
    "_attn_implementation": inert("attention kernel choice (sdpa, flex, eager): same math"),
    "attn_implementation": inert("attention kernel choice (sdpa, flex, eager): same math"),
}

EAGLE3_FIELDS: dict[str, FieldRule] = {
    "draft_vocab_size": used("rows of lm_head: the reduced draft vocabulary (d2t maps it to target ids)"),
    "target_hidden_size": used("width of the target features fc reads (3 x this); absent = hidden_size"),
    "eagle_config": used("vLLM's nested settings: eagle_aux_hidden_state_layer_ids (the taps)",
                         lambda v: isinstance(v, dict) and set(v) <= {"eagle_aux_hidden_state_layer_ids",
                                                                      "use_aux_hidden_state"}
                         and v.get("use_aux_hidden_state", True) is not False,
                         "only eagle_aux_hidden_state_layer_ids (and use_aux_hidden_state true)"),
    "eagle_aux_hidden_state_layer_ids": used("the taps: target hidden_states indices (absent = 2, L//2, L-3)"),
    "norm_before_residual": used("residual around attention is hidden_norm(h) instead of h (speculators)"),
    "bias": inert("EAGLE-1/2's fc bias switch in SafeAILab's loader; the EAGLE-3 fc has no bias"),
}

SPECULATORS_FIELDS: dict[str, FieldRule] = {
    "speculators_model_type": used("names the speculators algorithm (eagle3)"),
    "transformer_layer_config": used("the drafter layer's dims (Llama keys above)"),
    "norm_before_fc": used("an RMSNorm on the taps before fc (gpt-oss)", _falsy, "false"),
    "speculators_config": inert("proposal settings and the verifier's name; specrt sets draft shapes at run time"),
    "speculators_version": inert(_METADATA),
    "enable_sp_ulysses": inert("sequence parallelism for training"),
    "embed_requires_grad": inert("whether training updates the embedding"),
}

DFLASH_SUBFIELDS: dict[str, FieldRule] = {
    "block_size": used("block length B: anchor + B-1 masks"),
    "mask_token_id": used("token id whose (target) embedding fills the masked block positions"),
    "target_layer_ids": used("the taps as layer indices (hidden_states index - 1)"),
    "output_multiplier": used("scale on the draft logits", _one, "1.0"),
    "final_logit_softcapping": used("tanh soft cap on the draft logits", lambda v: not v, "absent or 0"),
    "input_embedding_scale": used("scale on the block's input embeddings", _one, "1.0"),
}

ZLAB_FIELDS: dict[str, FieldRule] = {
    "dflash_config": used("z-lab's nested settings (block_size, mask_token_id, target_layer_ids, ...)"),
    "num_target_layers": used("the target's layer count the drafter was trained with"),
    "is_causal": used("causal attention inside the block", _falsy, "false (the block is non-causal)"),
    **{k: r for k, r in DFLASH_SUBFIELDS.items()},  # z-lab also reads each of them at the top level
}

DEEPSPEC_FIELDS: dict[str, FieldRule] = {
    "target_layer_ids": used("the taps as layer indices (-1 = embeddings; hidden_states index - 1)"),
    "mask_token_id": used("token id whose (target) embedding fills the masked block positions"),
    "block_size": used("block length gamma: anchor + gamma-1 masks give gamma drafts"),
    "num_target_layers": used("the target's layer count the drafter was trained with"),
    "markov_rank": used("rank r of the Markov head (0: none, DFlash mode)"),
    "markov_head_type": used("Markov head variant: vanilla, gated or rnn"),
    "enable_confidence_head": used("whether a confidence head was trained (DSpark: required)"),
    "confidence_head_with_markov": used("confidence head reads [h ; W1[prev]] (true) or h alone"),
    "num_anchors": inert("anchors sampled per training sequence"),
    "sts_temperatures": used("specrt's confidence calibration (one temperature per block position)"),
}

FIELDS_BY_FORMAT: dict[str, dict[str, FieldRule]] = {
    EAGLE3.key: {**COMMON_FIELDS, **EAGLE3_FIELDS},
    EAGLE3_SPECULATORS.key: {**COMMON_FIELDS, **EAGLE3_FIELDS, **SPECULATORS_FIELDS},
    DFLASH_ZLAB.key: {**COMMON_FIELDS, **ZLAB_FIELDS},
    DFLASH_DEEPSPEC.key: {**COMMON_FIELDS, **DEEPSPEC_FIELDS},
    DSPARK.key: {**COMMON_FIELDS, **DEEPSPEC_FIELDS},
}


def _review(items: dict[str, Any], table: dict[str, FieldRule], where: str, fmt: DrafterFormat,
            source: str) -> list[tuple[str, str]]:
    ignored = []
    for key, value in items.items():
        rule = table.get(key)
        if rule is None:
            raise SpecrtError(
                f"{source}: unknown config field '{where}{key}' for a {fmt.name} drafter; specrt cannot tell "
                "whether it changes what the drafter computes",
                "if the field is only metadata, delete it from config.json (docs/drafter-formats.md lists "
                "every field specrt reads or ignores); otherwise this drafter variant is not supported",
            )
        if rule.inert:
            ignored.append((where + key, rule.what))
        elif rule.supported is not None and not rule.supported(value):
            raise SpecrtError(
                f"{source}: {where}{key}={value!r} is not supported ({rule.what}); specrt computes it only "
                f"for {rule.requirement}",
                "use a drafter without this variant; specrt refuses fields it would otherwise compute wrongly",
            )
    return ignored


def review_fields(hf: dict[str, Any], fmt: DrafterFormat, source: str = "config.json") -> list[tuple[str, str]]:
    """Check every config.json field against the format's table; returns the inert ones with why."""
    table = FIELDS_BY_FORMAT[fmt.key]
    ignored = _review(hf, table, "", fmt, source)
    if fmt is EAGLE3_SPECULATORS and isinstance(hf.get("transformer_layer_config"), dict):
        ignored += _review(hf["transformer_layer_config"], COMMON_FIELDS, "transformer_layer_config.", fmt, source)
    if fmt is DFLASH_ZLAB and isinstance(hf.get("dflash_config"), dict):
        ignored += _review(hf["dflash_config"], DFLASH_SUBFIELDS, "dflash_config.", fmt, source)
    return ignored


__all__ = [
    "DrafterFormat", "FORMATS", "EAGLE3", "EAGLE3_SPECULATORS", "DFLASH_ZLAB", "DFLASH_DEEPSPEC", "DSPARK",
    "FieldRule", "FIELDS_BY_FORMAT", "detect_format", "review_fields", "flat_eagle3_config",
]
