"""Drafter checkpoints shaped like each reference's own output (SafeAILab EAGLE-3, vLLM speculators,
z-lab DFlash, DeepSpec DFlash mode and DSpark): detected, computed exactly, or refused; and specrt's
own saves are what those references load. The tests write the folders themselves, from the formats'
published facts: key names, dtypes, config layouts, the extra buffers a raw trainer save carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from _onnx_tiny import TARGET_CFG, make_target, randomize
from test_drafter_models import heads, mlp, naive_attention, rms, rope
from specrt.export.checkpoints.drafter_formats import (
    COMMON_FIELDS, DEEPSPEC_FIELDS, DFLASH_SUBFIELDS, EAGLE3_FIELDS, SPECULATORS_FIELDS, ZLAB_FIELDS,
)
from specrt.export.checkpoints.drafters import load_drafter, read_drafter_checkpoint, save_drafter
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.plugins.errors import SpecrtError
from specrt.runtime.proposers.block import BlockProposer
from specrt.runtime.sampling import SamplingParams

L, V, H = TARGET_CFG.num_layers, TARGET_CFG.vocab_size, TARGET_CFG.hidden_size


@pytest.fixture(scope="module")
def target():
    return make_target(seed=5)


def quiet(*_):
    pass


# -- reference-shaped folders ----------------------------------------------------------------------
def hf_layer_keys(cfg, layers: int, model_type: str) -> dict:
    """The Llama / Qwen3 keys transformers writes for the drafter layers (what the references save)."""
    return {
        "architectures": None, "model_type": model_type, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": layers,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
        "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.51.3", "use_cache": True, "attention_dropout": 0.0,
    }


def write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def eagle3_module(draft_vocab: int = 40, seed: int = 1, **kw) -> Eagle3Drafter:
    cfg = Eagle3Config.for_target(TARGET_CFG, draft_vocab_size=draft_vocab, intermediate_size=40)
    d = Eagle3Drafter(Eagle3Config.from_dict({**cfg.to_dict(), **kw}))
    randomize(d, seed)
    if draft_vocab < V:
        ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values
        d.d2t.copy_(ids - torch.arange(draft_vocab))
        d.t2d.zero_()
        d.t2d[ids] = True
    return d.eval()


def safeailab_eagle3(folder: Path, d: Eagle3Drafter, target, raw_trainer: bool = False, **extra) -> Path:
    """As SafeAILab's EAGLE-3 code saves it: its Model's state dict (no d2t/t2d for a full vocabulary),
    a raw trainer save also holding the target's embedding and the RoPE buffer; `extra` config keys."""
    cfg = d.config
    config = {**hf_layer_keys(cfg, 1, "llama"), "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": cfg.draft_vocab_size, **extra}
    tensors = {k: v for k, v in d.state_dict().items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        del tensors["d2t"], tensors["t2d"]
    if raw_trainer:
        tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
        tensors["midlayer.self_attn.rotary_emb.inv_freq"] = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    return write(folder, config, tensors)


def speculators_eagle3(folder: Path, d: Eagle3Drafter, target, norm_before_residual: bool = False) -> Path:
    """vLLM speculators' layout: dims nested in transformer_layer_config, `layers.0.` names, the taps
    and norm_before_residual at the top level, the embedding saved with the drafter."""
    cfg = d.config
    layer = {k: v for k, v in hf_layer_keys(cfg, 1, "llama").items() if k != "architectures"}
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": norm_before_residual, "norm_before_fc": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.tap_layers), "embed_requires_grad": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
        "torch_dtype": "float32", "transformers_version": "4.56.0",
    }
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in d.state_dict().items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        del tensors["d2t"], tensors["t2d"]  # speculators keeps no vocabulary map for a full vocabulary
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    return write(folder, config, tensors)


def block_module(cls, seed: int = 2, **kw):
    cfg_cls = DSparkConfig if cls is DSparkDrafter else DFlashConfig
    extra = dict(markov_rank=8) if cls is DSparkDrafter else {}
    cfg = cfg_cls.for_target(TARGET_CFG, num_layers=2, block_size=4, num_taps=3, intermediate_size=40,
                             mask_token_id=V - 1, **extra)
    d = cls(cfg_cls.from_dict({**cfg.to_dict(), **kw}))
    return randomize(d, seed)


def zlab_dflash(folder: Path, d: DFlashDrafter, layer_ids: list[int] | None = None) -> Path:
    """z-lab's DFlashDraftModel: Qwen3 keys, dflash_config with layer indices, no embedding / LM head."""
    cfg = d.config
    config = {**hf_layer_keys(cfg, cfg.num_layers, "qwen3"), "architectures": ["DFlashDraftModel"],
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "attention_bias": False,
              "layer_types": ["full_attention"] * cfg.num_layers, "num_target_layers": L,
              "block_size": cfg.block_size, "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": cfg.num_layers,
              "dflash_config": {"mask_token_id": cfg.mask_token_id,
                                "target_layer_ids": layer_ids or cfg.target_layer_ids}}
    return write(folder, config, d.state_dict())


def deepspec(folder: Path, d: DFlashDrafter, target, dflash_mode: bool) -> Path:
    """DeepSpec's Qwen3DSparkModel: the target's config copied, its fields on top, and its frozen
    copies of the target's embedding and LM head in the state dict."""
    cfg = d.config
    config = {**hf_layer_keys(cfg, cfg.num_layers, "qwen3"), "architectures": ["Qwen3DSparkModel"],
              "attention_bias": False, "layer_types": ["full_attention"] * cfg.num_layers,
              "num_target_layers": L, "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
              "target_layer_ids": cfg.target_layer_ids, "num_anchors": 512,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": L}
    if dflash_mode:
        config.update(enable_confidence_head=False, markov_rank=0)
    else:
        config.update(enable_confidence_head=True, confidence_head_with_markov=cfg.confidence_with_markov,
                      markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_variant)
    tensors = {k: v for k, v in d.state_dict().items() if k != "sts_temperatures"}
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    tensors["lm_head.weight"] = target.lm_head.weight.detach().clone()
    return write(folder, config, tensors)


# -- independent references ------------------------------------------------------------------------
def reference_eagle3(folder: Path, emb_w, ids, taps, pos, mask):
    """EAGLE-3's one-layer drafter computed from the files alone, as the SafeAILab / speculators code
    does (norm_before_residual per speculators' first layer): (target-id argmax, logits)."""
    config = json.loads((folder / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    t = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    eps, theta = layer["rms_norm_eps"], layer["rope_theta"]
    nh, nkv, hd = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    hidden = F.linear(taps, t["fc.weight"])
    normed = rms(hidden, t["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([rms(F.embedding(ids, emb_w), t["midlayer.input_layernorm.weight"], eps), normed], -1)
    q = rope(heads(F.linear(x, t["midlayer.self_attn.q_proj.weight"]), nh, hd), pos, theta)
    k = rope(heads(F.linear(x, t["midlayer.self_attn.k_proj.weight"]), nkv, hd), pos, theta)
    v = heads(F.linear(x, t["midlayer.self_attn.v_proj.weight"]), nkv, hd)
    o = naive_attention(q, k, v, mask).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    residual = normed if config.get("norm_before_residual") else hidden
    h1 = residual + F.linear(o, t["midlayer.self_attn.o_proj.weight"])

    class M:  # the MLP weights by name
        gate_proj = type("W", (), {"weight": t["midlayer.mlp.gate_proj.weight"]})
        up_proj = type("W", (), {"weight": t["midlayer.mlp.up_proj.weight"]})
        down_proj = type("W", (), {"weight": t["midlayer.mlp.down_proj.weight"]})

    out = h1 + mlp(M, rms(h1, t["midlayer.post_attention_layernorm.weight"], eps))
    logits = F.linear(rms(out, t["norm.weight"], eps), t["lm_head.weight"])
    draft = logits.argmax(-1)
    # SafeAILab: with a full vocabulary d2t/t2d are deleted and draft id == target id
    d2t = t.get("d2t") if config["draft_vocab_size"] != layer["vocab_size"] else None
    return (draft if d2t is None else draft + d2t[draft]), logits


def reference_embedding(folder: Path, target_embed: torch.Tensor) -> torch.Tensor | None:
    """The embedding SafeAILab's `Model(config, load_emb=True, path=base)` ends up with: the target's
    when config.json has no target_hidden_size, then whatever `embed_tokens.weight` the file holds
    (load_state_dict strict=False); None = left at its random init."""
    config = json.loads((folder / "config.json").read_text())
    emb = None if "target_hidden_size" in config else target_embed
    return load_file(str(folder / "model.safetensors")).get("embed_tokens.weight", emb)


def eagle3_inputs(seed: int = 0, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(1, t, 3 * H, generator=g)
    ids = torch.randint(0, V, (1, t), generator=g)
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    return ids, taps, pos, mask


def specrt_eagle3(d: Eagle3Drafter, ids, taps, pos, mask):
    kc, vc = d.new_cache(1, ids.shape[1])
    with torch.no_grad():
        logits, _ = d(ids, d.fuse(taps), pos, mask, kc, vc, pos)
    return d.draft_to_target(logits.argmax(-1)), logits


def bind(d, target):
    if isinstance(d, Eagle3Drafter):
        if d.embed_tokens is None:
            d.bind_target_embedding(target.embed_tokens)
    else:
        d.bind_target(target.embed_tokens, target.lm_head)
    return d


# -- EAGLE-3 ----------------------------------------------------------------------------------------
def test_eagle3_full_vocabulary_without_d2t_t2d_loads(tmp_path, target):
    """SafeAILab drops d2t/t2d when draft_vocab_size == vocab_size (ids map 1:1); it must load."""
    d = eagle3_module(draft_vocab=V)
    folder = safeailab_eagle3(tmp_path / "full", d, target)
    assert "d2t" not in load_file(str(folder / "model.safetensors"))
    back = bind(load_drafter(folder, TARGET_CFG, say=quiet), target)
    assert back.config.draft_vocab_size == V and back.config.checkpoint_format == "eagle3"
    inputs = eagle3_inputs()
    want_ids, want_logits = reference_eagle3(folder, target.embed_tokens.weight, *inputs)
    got_ids, got_logits = specrt_eagle3(back, *inputs)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)


def test_eagle3_raw_trainer_save_ignores_rope_buffers_and_names_them(tmp_path, target):
    d = eagle3_module(draft_vocab=40)
    folder = safeailab_eagle3(tmp_path / "raw", d, target, raw_trainer=True)
    said: list[str] = []
    back = bind(load_drafter(folder, TARGET_CFG, say=said.append), target)
    assert len(said) == 2 and "detected EAGLE-3" in said[0]
    assert "midlayer.self_attn.rotary_emb.inv_freq" in said[1]
    inputs = eagle3_inputs(1)
    want_ids, want_logits = reference_eagle3(folder, target.embed_tokens.weight, *inputs)
    got_ids, got_logits = specrt_eagle3(back, *inputs)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    # a real weight that is not part of the drafter is still refused
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["midlayer.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(SpecrtError, match="unexpected tensors .*q_proj.bias"):
        load_drafter(folder, TARGET_CFG, say=quiet)


def test_eagle3_top_level_aux_layer_ids_are_the_taps(tmp_path, target):
    """vLLM reads `eagle_aux_hidden_state_layer_ids` at the top level as well as in eagle_config."""
    d = eagle3_module()
    folder = safeailab_eagle3(tmp_path / "e", d, target)
    config = json.loads((folder / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_drafter(folder, TARGET_CFG, say=quiet).config.tap_layers == [1, 3, 5]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 3, 5]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecrtError, match="disagree"):
        load_drafter(folder, TARGET_CFG, say=quiet)


@pytest.mark.parametrize("layout", ["flat", "speculators"])
def test_eagle3_norm_before_residual_computes_like_the_reference(tmp_path, target, layout):
    """speculators' variant: the residual around attention is hidden_norm(h); vLLM reads it flat too."""
    d = eagle3_module(tap_layers=[1, 3, 4])
    if layout == "flat":
        folder = safeailab_eagle3(tmp_path / "flat", d, target, norm_before_residual=True,
                                  eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    else:
        folder = speculators_eagle3(tmp_path / "spec", d, target, norm_before_residual=True)
    back = bind(load_drafter(folder, TARGET_CFG, say=quiet), target)
    assert back.config.tap_layers == [1, 3, 4]
    inputs = eagle3_inputs(2)
    want_ids, want_logits = reference_eagle3(folder, target.embed_tokens.weight, *inputs)
    got_ids, got_logits = specrt_eagle3(back, *inputs)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert back.config.checkpoint_format == ("eagle3" if layout == "flat" else "eagle3-speculators")
    # and the variant matters: the plain residual gives other logits
    plain = json.loads((folder / "config.json").read_text())
    plain["norm_before_residual"] = False
    (folder / "config.json").write_text(json.dumps(plain))
    assert not torch.allclose(reference_eagle3(folder, target.embed_tokens.weight, *inputs)[1], want_logits)


def test_eagle3_saved_by_specrt_runs_in_the_reference(tmp_path, target):
    """SafeAILab reads the target's embedding only when config.json has no target_hidden_size."""
    d = bind(eagle3_module(), target)
    folder = save_drafter(d, tmp_path / "saved", dtype=torch.float32)
    emb = reference_embedding(folder, target.embed_tokens.weight.detach())
    assert emb is not None and torch.equal(emb, target.embed_tokens.weight)
    inputs = eagle3_inputs(3)
    want_ids, want_logits = reference_eagle3(folder, emb, *inputs)
    got_ids, got_logits = specrt_eagle3(d, *inputs)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    # a drafter with its own embedding (other width than the target) carries it and says so
    own = bind(eagle3_module(own_embedding=True), target)
    folder = save_drafter(own, tmp_path / "own", dtype=torch.float32)
    assert torch.equal(reference_embedding(folder, target.embed_tokens.weight), own.embed_tokens.weight)


# -- DeepSpec DFlash mode, DSpark, z-lab DFlash ---------------------------------------------------
def proposer_drafts(d, target, anchors=(7, 30)) -> tuple[torch.Tensor, torch.Tensor]:
    """A BlockProposer's greedy chains for a 5-token context per row, and the drafter's raw logits."""
    g = torch.Generator().manual_seed(4)
    taps = torch.randn(len(anchors), 5, len(d.config.tap_layers) * H, generator=g)
    prop = BlockProposer(d)
    prop.reset(len(anchors), 32)
    prop.observe(list(range(len(anchors))), [torch.arange(5)] * len(anchors), list(taps), None)
    got = prop.propose(list(range(len(anchors))), list(anchors), SamplingParams(temperature=0.0), None)
    bk = d.config.block_size
    pos = torch.arange(5, 5 + bk).expand(len(anchors), bk)
    kc, vc = d.new_cache(len(anchors), 32)
    d.ingest_context(taps, torch.arange(5).expand(len(anchors), 5), kc, vc, torch.arange(5).expand(len(anchors), 5))
    mask = torch.ones(len(anchors), bk, 5 + bk, dtype=torch.bool)
    with torch.no_grad():
        logits, _ = d(d.block_ids(torch.tensor(anchors)), pos, mask, kc, vc, pos)
    return torch.stack([p.tokens for p in got]), logits


def test_deepspec_dflash_mode_loads_with_its_own_convention(tmp_path, target):
    """DeepSpec's DFlash drafters (DSpark model, Markov rank 0, no confidence head): index k predicts p+k+1."""
    d = block_module(DFlashDrafter, convention="deepspec")
    folder = deepspec(tmp_path / "ds", d, target, dflash_mode=True)
    said: list[str] = []
    back = bind(load_drafter(folder, TARGET_CFG, say=said.append), target)  # kind inferred
    assert type(back) is DFlashDrafter and back.config.convention == "deepspec" and back.label_shift == 1
    assert "DeepSpec DFlash" in said[0] and "4 drafts (index k predicts p+k+1)" in said[0]
    assert "embed_tokens.weight" in said[1] and "lm_head.weight" in said[1]
    assert load_drafter(folder, TARGET_CFG, kind="dflash", say=quiet).config.convention == "deepspec"
    drafts, logits = proposer_drafts(back, target)
    assert drafts.shape == (2, 4)
    assert torch.equal(drafts, logits.argmax(-1))  # every block row is a draft, row 0 predicts p+1
    # the same weights under z-lab's convention would draft one position late
    zlab = bind(block_module(DFlashDrafter), target)
    zlab.load_state_dict(back.state_dict())
    late, _ = proposer_drafts(zlab, target)
    assert torch.equal(late, logits.argmax(-1)[:, 1:])
    with pytest.raises(SpecrtError, match="not a dspark drafter"):
        load_drafter(folder, TARGET_CFG, kind="dspark", say=quiet)


def test_deepspec_dspark_and_zlab_dflash_load_and_match(tmp_path, target):
    s = bind(block_module(DSparkDrafter), target)
    back = bind(load_drafter(deepspec(tmp_path / "sp", s, target, dflash_mode=False), TARGET_CFG, say=quiet), target)
    assert type(back) is DSparkDrafter and back.config.checkpoint_format == "dspark-deepspec"
    assert torch.equal(proposer_drafts(back, target)[0], proposer_drafts(s, target)[0])
    z = bind(block_module(DFlashDrafter), target)
    back = bind(load_drafter(zlab_dflash(tmp_path / "z", z), TARGET_CFG, say=quiet), target)
    assert back.config.convention == "z-lab" and back.label_shift == 0
    drafts, logits = proposer_drafts(back, target)
    assert torch.equal(drafts, logits.argmax(-1)[:, 1:])


def test_zlab_dflash_tap_on_the_last_layer_is_refused(tmp_path, target):
    """z-lab reads hidden_states[layer_id + 1]; for the last layer that is after the target's final norm."""
    z = block_module(DFlashDrafter)
    folder = zlab_dflash(tmp_path / "z", z, layer_ids=[1, 3, L - 1])
    with pytest.raises(SpecrtError, match="last layer.*final norm"):
        load_drafter(folder, TARGET_CFG, say=quiet)
    # DeepSpec hooks the layers' raw outputs, which is what specrt's taps are: accepted
    d = block_module(DFlashDrafter, convention="deepspec", tap_layers=[2, 4, L])
    assert load_drafter(deepspec(tmp_path / "ds", d, target, dflash_mode=True), TARGET_CFG,
                        say=quiet).config.tap_layers == [2, 4, L]


# -- the field rule -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,field,value", [
    ("safeailab", "norm_before_fc", True),
    ("safeailab", "some_future_scale", 2.0),
    ("speculators", "norm_before_fc", True),
    ("zlab", "is_causal", True),
    ("zlab", "output_multiplier", 0.5),
    ("deepspec", "attention_bias", True),
    ("deepspec", "quantization_config", {"bits": 4}),
])
def test_fields_that_change_the_computation_are_refused(tmp_path, target, fmt, field, value):
    if fmt == "safeailab":
        folder = safeailab_eagle3(tmp_path / "f", eagle3_module(), target)
    elif fmt == "speculators":
        folder = speculators_eagle3(tmp_path / "f", eagle3_module(), target)
    elif fmt == "zlab":
        folder = zlab_dflash(tmp_path / "f", block_module(DFlashDrafter))
    else:
        folder = deepspec(tmp_path / "f", block_module(DSparkDrafter), target, dflash_mode=False)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecrtError, match=field) as err:
        load_drafter(folder, TARGET_CFG, say=quiet)
    assert err.value.fix


def test_inert_fields_are_listed_with_the_reason(tmp_path, target):
    ckpt = read_drafter_checkpoint(speculators_eagle3(tmp_path / "s", eagle3_module(), target), TARGET_CFG)
    ignored = dict(ckpt.ignored_fields)
    assert "speculators_config" in ignored and "transformer_layer_config.initializer_range" in ignored
    assert "embed_tokens.weight" not in dict(ckpt.ignored_tensors)  # speculators' embedding is loaded
    tables = (COMMON_FIELDS, EAGLE3_FIELDS, SPECULATORS_FIELDS, ZLAB_FIELDS, DFLASH_SUBFIELDS, DEEPSPEC_FIELDS)
    for table in tables:
        for name, rule in table.items():
            assert rule.what, name
            assert rule.inert or rule.supported is None or rule.requirement, name


def test_docs_list_every_config_field():
    docs = (Path(__file__).parents[1] / "docs" / "drafter-formats.md").read_text()
    tables = (COMMON_FIELDS, EAGLE3_FIELDS, SPECULATORS_FIELDS, ZLAB_FIELDS, DFLASH_SUBFIELDS, DEEPSPEC_FIELDS)
    missing = [name for table in tables for name in table if f"`{name}`" not in docs]
    assert not missing


# -- round trip -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["eagle3", "eagle3-full-vocab", "eagle3-norm-before-residual", "dflash-zlab",
                                     "dflash-deepspec", "dspark"])
def test_round_trip_specrt_reference_specrt_is_bit_identical(tmp_path, target, variant):
    if variant.startswith("eagle3"):
        d = eagle3_module(draft_vocab=V if variant == "eagle3-full-vocab" else 40,
                          norm_before_residual=variant == "eagle3-norm-before-residual")
    elif variant == "dspark":
        d = block_module(DSparkDrafter)
        d.sts_temperatures.copy_(torch.tensor([0.7, 1.0, 1.3, 2.0]))
    else:
        d = block_module(DFlashDrafter, convention="z-lab" if variant == "dflash-zlab" else "deepspec")
    first = save_drafter(d, tmp_path / "a", dtype=torch.float32)
    back = load_drafter(first, TARGET_CFG, say=quiet)
    assert back.config == d.config
    state, want = back.state_dict(), d.state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)
    second = save_drafter(back, tmp_path / "b", dtype=torch.float32)
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


# -- specrt inspect-drafter -----------------------------------------------------------------------
def test_inspect_drafter_cli(tmp_path, target, capsys):
    from _onnx_tiny import write_hf_target
    from specrt.tools.cli import main

    tiny = write_hf_target(tmp_path / "tiny", target)
    folder = deepspec(tmp_path / "ds", block_module(DFlashDrafter, convention="deepspec"), target, dflash_mode=True)
    assert main(["inspect-drafter", str(folder), "--target", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "DeepSpec DFlash" in out and "tiny: fits" in out and "taps         target hidden_states [2, 3, 4]" in out
    assert "4 inputs, 4 drafts; convention deepspec" in out
    assert "num_anchors" in out and "lm_head.weight" in out  # ignored field and tensor, each with why
    small = tmp_path / "small"
    small.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 80}))
    assert main(["inspect-drafter", str(folder), "--target", str(small)]) == 1
    assert "DOES NOT FIT: DFlash drafter vocab mismatch" in capsys.readouterr().out
    assert main(["inspect-drafter", str(folder), "--target", str(tiny), "--kind", "dspark"]) == 2
    assert "--drafter dflash" in capsys.readouterr().err


# -- engine folders: the conventions on ONNX Runtime --------------------------------------------------
ENGINE_FORMATS = ("dflash-deepspec", "eagle3-speculators")
PROMPTS = [[5, 9, 23, 7], [3, 44, 12, 60, 8, 31, 2]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Engine folders exported from reference-shaped checkpoints of the two conventions the runtime
    treats specially: DeepSpec's DFlash mode (index k predicts p+k+1) and speculators' EAGLE-3 (full
    vocabulary without d2t/t2d, norm_before_residual, top-level taps, its own embedding copy)."""
    pytest.importorskip("onnxruntime")
    import logging

    from _onnx_tiny import make_sharp_target, write_hf_target
    from specrt.tools.cli_export import main as export_main

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("formats")
    target = make_sharp_target(seed=3)
    write_hf_target(root / "tiny", target)
    ckpts = {
        "dflash-deepspec": deepspec(root / "ckpt-dflash-deepspec", block_module(DFlashDrafter, convention="deepspec"),
                                    target, dflash_mode=True),
        "eagle3-speculators": speculators_eagle3(root / "ckpt-eagle3-speculators",
                                                 eagle3_module(draft_vocab=V, tap_layers=[1, 3, 4]), target,
                                                 norm_before_residual=True),
    }
    out = {}
    for name, ckpt in ckpts.items():
        kind = name.split("-")[0]
        out[name] = root / f"engine-{name}"
        assert export_main(["--drafter", kind, "--target", str(root / "tiny"), "--drafter-ckpt", str(ckpt),
                            "--out", str(out[name]), "--no-ort-fused", "--no-lookup-files", "--quiet"]) == 0
    return {"root": root, "ckpts": ckpts, "engines": out}


@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_engine_folder_greedy_equals_plain_and_drafts_equal_torch(engines, name):
    from specrt.export.draft_options import DraftOptions
    from specrt.runtime.pipeline import Pipeline

    kind = name.split("-")[0]
    manifest = json.loads((engines["engines"][name] / "manifest.json").read_text())["drafter"]
    assert manifest["config"]["checkpoint_format"] == name
    if kind == "dflash":
        assert manifest["config"]["convention"] == "deepspec" and manifest["label_shift"] == 1
        assert manifest["num_drafts"] == 4
    else:
        assert manifest["config"]["norm_before_residual"] is True and manifest["tap_layers"] == [1, 3, 4]
    options = DraftOptions(lookup=0)  # the drafter's own drafts, no copies grafted on
    tiny = engines["root"] / "tiny"
    plain = Pipeline.from_checkpoint(tiny).generate_ids(PROMPTS, 20)
    torch_spec = Pipeline.from_checkpoint(tiny, drafter=kind, drafter_ckpt=engines["ckpts"][name], draft_options=options)
    ort_spec = Pipeline.from_engines(engines["engines"][name], drafter=kind, draft_options=options, measured=False)
    for i, prompt in enumerate(PROMPTS):
        got, ref = ort_spec.generate_ids([prompt], 20), torch_spec.generate_ids([prompt], 20)
        assert got.tokens[0] == plain.tokens[i] == ref.tokens[0]
        assert got.stats[0].accepted_per_position == ref.stats[0].accepted_per_position
    # the drafts themselves: both proposers on the same context features
    g = torch.Generator().manual_seed(11)
    width = len(torch_spec.proposer.tap_layers) * H
    taps = [torch.randn(6, width, generator=g), torch.randn(3, width, generator=g)]
    tokens = [torch.tensor([4, 8, 15, 16, 23, 42]), torch.tensor([7, 7, 9])]
    proposals = []
    for proposer in (torch_spec.proposer, ort_spec.proposer):
        proposer.reset(2, 32)
        proposer.observe([0, 1], tokens, taps, [50, 51])
        proposals.append(proposer.propose([0, 1], [50, 51], SamplingParams(temperature=0.0), None))
    for want, got in zip(*proposals):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
        if kind == "dflash":
            assert len(got.tokens) == 4  # B inputs, B drafts
