"""Drafter checkpoints: official key names and config.json, round trips, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specrt.export.checkpoints.drafters import check_fits_target, infer_kind, load_drafter, save_drafter
from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.export.models.llama import LlamaModel

TARGET = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4, num_kv_heads=2,
)


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if ("norm" in name) else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def target():
    t = LlamaModel(TARGET)
    randomize(t, 100)
    return t.eval()


def make(kind, **kw):
    if kind == "eagle3":
        cfg = Eagle3Config.for_target(TARGET, draft_vocab_size=40)
        d = Eagle3Drafter(Eagle3Config.from_dict({**cfg.to_dict(), **kw}))
    elif kind == "dflash":
        d = DFlashDrafter(DFlashConfig.for_target(TARGET, num_layers=2, block_size=4, mask_token_id=60, **kw))
    else:
        cfg = DSparkConfig.for_target(TARGET, num_layers=2, block_size=3, mask_token_id=60, markov_rank=8, **kw)
        d = DSparkDrafter(cfg)
    randomize(d, 1)
    if kind == "eagle3":
        d.d2t.copy_(torch.arange(40) % 5)
        d.t2d.zero_()
        d.t2d[d.draft_to_target(torch.arange(40))] = True
    if kind == "dspark":
        d.sts_temperatures.copy_(torch.tensor([0.5, 1.0, 2.0]))
    return d.eval()


def bind(d, target):
    if isinstance(d, Eagle3Drafter):
        if d.embed_tokens is None:
            d.bind_target_embedding(target.embed_tokens)
    else:
        d.bind_target(target.embed_tokens, target.lm_head)
    return d


def run(d, target):
    """Deterministic outputs of a drafter on fixed inputs, fresh caches."""
    g = torch.Generator().manual_seed(42)
    b = 2
    with torch.no_grad():
        if isinstance(d, Eagle3Drafter):
            t = 4
            taps = torch.randn(b, t, 96, generator=g)
            ids = torch.randint(0, 64, (b, t), generator=g)
            pos = torch.arange(t).expand(b, t)
            mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
            kc, vc = d.new_cache(b, t)
            logits, out = d(ids, d.fuse(taps), pos, mask, kc, vc, pos)
            return [logits, out, d.draft_to_target(logits.argmax(-1))]
        cfg = d.config
        tc, bk = 3, cfg.block_size
        taps = torch.randn(b, tc, len(cfg.tap_layers) * 32, generator=g)
        ctx_pos = torch.arange(tc).expand(b, tc)
        block = d.block_ids(torch.randint(0, 64, (b,), generator=g))
        block_pos = torch.arange(tc, tc + bk).expand(b, bk)
        mask = torch.ones(b, bk, tc + bk, dtype=torch.bool)
        kc, vc = d.new_cache(b, tc + bk)
        d.ingest_context(taps, ctx_pos, kc, vc, ctx_pos)
        if isinstance(d, DSparkDrafter):
            tokens, _, conf = d.draft(block, block_pos, mask, kc, vc, block_pos, 0.0)
            logits, hidden = d(block, block_pos, mask, kc, vc, block_pos)
            return [logits, hidden, conf, d.survival(conf), tokens]
        logits, hidden = d(block, block_pos, mask, kc, vc, block_pos)
        return [logits, hidden]


EAGLE3_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}
DFLASH_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{n}"
    for i in range(2)
    for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    )
}
DSPARK_KEYS = DFLASH_KEYS | {
    "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
    "confidence_head.proj.weight", "confidence_head.proj.bias",
}
KEYS = {"eagle3": EAGLE3_KEYS, "dflash": DFLASH_KEYS, "dspark": DSPARK_KEYS}


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_official_key_names_and_config(kind, tmp_path):
    d = make(kind)
    save_drafter(d, tmp_path, dtype=torch.float16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == KEYS[kind]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["norm.weight"].dtype == torch.float16
    hf = json.loads((tmp_path / "config.json").read_text())
    assert infer_kind(hf) == kind
    assert hf["hidden_size"] == 32 and hf["vocab_size"] == 64 and hf["torch_dtype"] == "float16"
    if kind == "eagle3":
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
        assert hf["draft_vocab_size"] == 40 and hf["num_hidden_layers"] == 1
        # SafeAILab's loader reads the target's embedding only when target_hidden_size is absent
        assert "target_hidden_size" not in hf
        assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    elif kind == "dflash":
        assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
        assert hf["num_hidden_layers"] == 2 and hf["num_target_layers"] == 6
        # z-lab's target_layer_ids are layer indices: our hidden_states taps minus one
        assert hf["dflash_config"] == {
            "block_size": 4, "mask_token_id": 60, "target_layer_ids": [t - 1 for t in d.config.tap_layers]
        }
    else:
        assert hf["architectures"] == ["Qwen3DSparkModel"]
        assert hf["markov_rank"] == 8 and hf["markov_head_type"] == "vanilla" and hf["block_size"] == 3
        assert hf["target_layer_ids"] == [t - 1 for t in d.config.tap_layers]
        assert hf["enable_confidence_head"] is True and hf["confidence_head_with_markov"] is True
        assert hf["sts_temperatures"] == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_round_trip_fp32_identical_fp16_close(kind, tmp_path, target):
    d = bind(make(kind), target)
    want = run(d, target)
    save_drafter(d, tmp_path / "fp32", dtype=torch.float32)
    back = bind(load_drafter(tmp_path / "fp32", TARGET), target)  # kind inferred from config.json
    assert type(back) is type(d)
    assert back.config == d.config
    for a, b in zip(run(back, target), want):
        assert torch.equal(a, b)
    save_drafter(d, tmp_path / "fp16", dtype=torch.float16)
    back16 = bind(load_drafter(tmp_path / "fp16", TARGET, kind=kind), target)
    got = run(back16, target)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)
    if kind == "dspark":
        assert torch.equal(back16.sts_temperatures, d.sts_temperatures)


def test_dspark_variants_round_trip(tmp_path, target):
    for variant, key in (("gated", "markov_head.gate_proj.weight"), ("gru", "markov_head.joint_proj.weight")):
        d = bind(make("dspark", markov_variant=variant), target)
        save_drafter(d, tmp_path / variant, dtype=torch.float32)
        hf = json.loads((tmp_path / variant / "config.json").read_text())
        assert hf["markov_head_type"] == ("rnn" if variant == "gru" else variant)  # DeepSpec's names
        with safe_open(str(tmp_path / variant / "model.safetensors"), "pt") as f:
            assert key in set(f.keys())
        back = bind(load_drafter(tmp_path / variant, TARGET), target)
        assert back.config.markov_variant == variant
        for a, b in zip(run(back, target), run(d, target)):
            assert torch.equal(a, b)


def test_eagle3_own_embedding_round_trip(tmp_path, target):
    d = make("eagle3", own_embedding=True)
    save_drafter(d, tmp_path, dtype=torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == EAGLE3_KEYS | {"embed_tokens.weight"}
    back = load_drafter(tmp_path, TARGET)
    assert back.config.own_embedding and back.embed_tokens is not None
    for a, b in zip(run(back, target), run(d, target)):
        assert torch.equal(a, b)


def test_foreign_layouts_load(tmp_path, target):
    """SpecForge-style EAGLE-3 `layers.0.` names and DeepSpec's stored copies of embed/lm_head."""
    d = bind(make("eagle3"), target)
    save_drafter(d, tmp_path / "e", dtype=torch.float32)
    path = tmp_path / "e" / "model.safetensors"
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(path)).items()}
    save_file(renamed, str(path))
    back = bind(load_drafter(tmp_path / "e", TARGET), target)
    for a, b in zip(run(back, target), run(d, target)):
        assert torch.equal(a, b)

    s = bind(make("dspark"), target)
    save_drafter(s, tmp_path / "s", dtype=torch.float32)
    path = tmp_path / "s" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["embed_tokens.weight"] = torch.zeros(64, 32)
    tensors["lm_head.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(path))
    back = bind(load_drafter(tmp_path / "s", TARGET), target)
    for a, b in zip(run(back, target), run(s, target)):
        assert torch.equal(a, b)


# -- refusals ------------------------------------------------------------------------------------
def other_target(**kw) -> LlamaConfig:
    return LlamaConfig(**{**TARGET.to_dict(), **kw})


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_refuses_drafters_that_do_not_fit(kind, tmp_path):
    save_drafter(make(kind), tmp_path, dtype=torch.float16)
    with pytest.raises(SpecrtError, match="hidden size mismatch"):
        load_drafter(tmp_path, other_target(hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8))
    with pytest.raises(SpecrtError, match="vocab mismatch") as err:
        load_drafter(tmp_path, other_target(vocab_size=80))
    assert "64" in str(err.value) and "80" in str(err.value)
    with pytest.raises(SpecrtError, match="tap layers") as err:
        load_drafter(tmp_path, other_target(num_layers=2))
    assert err.value.fix


def test_check_fits_target_directly():
    check_fits_target(make("dflash").config, TARGET)
    cfg = DFlashConfig.from_dict({**make("dflash").config.to_dict(), "mask_token_id": 64})
    with pytest.raises(SpecrtError, match="mask_token_id"):
        check_fits_target(cfg, TARGET)
    cfg = Eagle3Config.from_dict({**make("eagle3").config.to_dict(), "tap_layers": [1, 2]})
    with pytest.raises(SpecrtError, match="3 tap layers"):
        check_fits_target(cfg, TARGET)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(SpecrtError, match="not found"):
        load_drafter(tmp_path / "nope", TARGET)
    save_drafter(make("dspark"), tmp_path / "a")
    (tmp_path / "a" / "config.json").unlink()
    with pytest.raises(SpecrtError, match="config.json"):
        load_drafter(tmp_path / "a", TARGET)

    save_drafter(make("eagle3"), tmp_path / "b")
    weights = tmp_path / "b" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecrtError, match="truncated or corrupt"):
        load_drafter(tmp_path / "b", TARGET)

    save_drafter(make("dflash"), tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").unlink()
    with pytest.raises(SpecrtError, match="model.safetensors"):
        load_drafter(tmp_path / "c", TARGET)

    save_drafter(make("dflash"), tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{ not json")
    with pytest.raises(SpecrtError, match="not valid JSON"):
        load_drafter(tmp_path / "d", TARGET)


def test_unknown_kind_and_wrong_weights(tmp_path):
    save_drafter(make("dflash"), tmp_path / "a")
    hf = json.loads((tmp_path / "a" / "config.json").read_text())
    for key in ("architectures", "model_type", "dflash_config"):
        hf.pop(key)
    (tmp_path / "a" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(SpecrtError, match="cannot tell which drafter"):
        load_drafter(tmp_path / "a", TARGET)
    with pytest.raises(SpecrtError, match="unknown drafter kind"):
        load_drafter(tmp_path / "a", TARGET, kind="medusa")
    # a DFlash checkpoint asked for as DSpark: the config says which it is
    save_drafter(make("dflash"), tmp_path / "b")
    with pytest.raises(SpecrtError, match="z-lab DFlash checkpoint .* not a dspark drafter") as err:
        load_drafter(tmp_path / "b", TARGET, kind="dspark")
    assert "--drafter dflash" in err.value.fix
    # a lost tensor
    save_drafter(make("eagle3"), tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(SpecrtError, match="midlayer.hidden_norm.weight"):
        load_drafter(tmp_path / "c", TARGET)
    with pytest.raises(SpecrtError, match="float64"):
        save_drafter(make("eagle3"), tmp_path / "x", dtype=torch.float64)
