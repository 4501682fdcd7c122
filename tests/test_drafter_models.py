"""Drafter models (EAGLE-3, DFlash, DSpark) against naive re-computations of the same math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter, default_dflash_taps, dflash_target_layer_ids
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter, default_eagle3_taps
from specrt.export.models.llama import LlamaModel

TARGET = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4, num_kv_heads=2,
    rope_theta=10000.0,
)


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, norms around 1, so mixed-up tensors show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    f = pos.float()[..., None] * inv
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def naive_attention(q, k, v, mask):
    """q [B,Hq,T,D], k/v [B,Hkv,S,D], mask [B,T,S] bool (None = all)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


def heads(x, n, d):
    b, t, _ = x.shape
    return x.view(b, t, n, d).transpose(1, 2)


def mlp(m, x):
    return F.linear(F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight), m.down_proj.weight)


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def test_default_taps_follow_the_references():
    assert default_eagle3_taps(30) == [2, 15, 27]
    # z-lab: layer ids for a 36-layer Qwen3-8B and the 52-layer fixture; ours are hidden_states = id + 1
    assert dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert dflash_target_layer_ids(30, 1) == [15]
    assert default_dflash_taps(36) == [2, 10, 18, 26, 34]
    cfg = DFlashConfig.for_target(LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=36,
                                              num_heads=2, num_kv_heads=2))
    assert cfg.tap_layers == [2, 10, 18, 26, 34] and cfg.target_layer_ids == [1, 9, 17, 25, 33]


def test_config_dict_round_trip():
    for cfg in (
        Eagle3Config.for_target(TARGET, 40),
        DFlashConfig.for_target(TARGET, num_layers=2, block_size=4, mask_token_id=5),
        DSparkConfig.for_target(TARGET, markov_rank=8, markov_variant="rnn"),
    ):
        again = type(cfg).from_dict(cfg.to_dict())
        assert again == cfg
    assert DSparkConfig.for_target(TARGET, markov_variant="rnn").markov_variant == "gru"
    with pytest.raises(SpecrtError, match="markov variant"):
        DSparkConfig.for_target(TARGET, markov_variant="lstm")


# ---------------------------------------------------------------------------------------------
# EAGLE-3
# ---------------------------------------------------------------------------------------------
def make_eagle3(seed=0, **kw) -> tuple[Eagle3Drafter, torch.nn.Embedding]:
    cfg = Eagle3Config.for_target(TARGET, draft_vocab_size=40)
    for k, v in kw.items():
        setattr(cfg, k, v)
    d = Eagle3Drafter(cfg)
    randomize(d, seed)
    emb = torch.nn.Embedding(TARGET.vocab_size, TARGET.hidden_size)
    torch.nn.init.normal_(emb.weight, std=0.5, generator=torch.Generator().manual_seed(seed + 1))
    if d.embed_tokens is None:
        d.bind_target_embedding(emb)
    return d.eval(), emb


def eagle3_naive(d: Eagle3Drafter, emb_w, ids, hidden, pos, mask, norm_before_residual: bool = False):
    cfg, m = d.config, d.midlayer
    e = F.embedding(ids, emb_w)
    eps = cfg.rms_norm_eps
    x = torch.cat([rms(e, m.input_layernorm.weight, eps), rms(hidden, m.hidden_norm.weight, eps)], -1)
    a = m.self_attn
    q = rope(heads(F.linear(x, a.q_proj.weight), cfg.num_heads, cfg.head_dim), pos, cfg.rope_theta)
    k = rope(heads(F.linear(x, a.k_proj.weight), cfg.num_kv_heads, cfg.head_dim), pos, cfg.rope_theta)
    v = heads(F.linear(x, a.v_proj.weight), cfg.num_kv_heads, cfg.head_dim)
    o = naive_attention(q, k, v, mask).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    residual = rms(hidden, m.hidden_norm.weight, eps) if norm_before_residual else hidden
    h1 = residual + F.linear(o, a.o_proj.weight)
    out = h1 + mlp(m.mlp, rms(h1, m.post_attention_layernorm.weight, cfg.rms_norm_eps))
    return F.linear(rms(out, d.norm.weight, cfg.rms_norm_eps), d.lm_head.weight), out


def test_eagle3_shapes_and_names():
    d, _ = make_eagle3()
    names = set(d.state_dict())
    for n in ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
              "midlayer.self_attn.q_proj.weight", "midlayer.post_attention_layernorm.weight",
              "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
        assert n in names
    assert "target_embed_weight" not in names and not any(n.startswith("embed_tokens") for n in names)
    assert d.fc.weight.shape == (32, 96)
    assert d.midlayer.self_attn.q_proj.weight.shape == (32, 64)
    assert d.midlayer.self_attn.k_proj.weight.shape == (16, 64)
    assert d.d2t.dtype == torch.int64 and d.d2t.shape == (40,)
    assert d.t2d.dtype == torch.bool and d.t2d.shape == (64,)
    b, t = 2, 5
    taps = torch.randn(b, t, 96)
    h = d.fuse(taps)
    assert h.shape == (b, t, 32)
    kc, vc = d.new_cache(b, 8)
    assert kc.shape == (1, b, 2, 8, 8)
    ids = torch.randint(0, 64, (b, t))
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    logits, out = d(ids, h, pos, mask, kc, vc, pos)
    assert logits.shape == (b, t, 40) and logits.dtype == torch.float32
    assert out.shape == (b, t, 32)


def test_eagle3_forward_matches_naive_math():
    d, emb = make_eagle3(seed=3)
    b, t = 2, 6
    g = torch.Generator().manual_seed(7)
    hidden = d.fuse(torch.randn(b, t, 96, generator=g))
    ids = torch.randint(0, 64, (b, t), generator=g)
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    kc, vc = d.new_cache(b, t + 2)
    with torch.no_grad():
        logits, out = d(ids, hidden, pos, mask, kc, vc, pos)
        ref_logits, ref_out = eagle3_naive(d, emb.weight, ids, hidden, pos, mask)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)


def test_eagle3_norm_before_residual_matches_naive_math():
    """speculators' variant: the attention residual is hidden_norm(hidden) instead of hidden."""
    d, emb = make_eagle3(seed=5, norm_before_residual=True)
    b, t = 1, 4
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(b, t, 32, generator=g)
    ids = torch.randint(0, 64, (b, t), generator=g)
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    kc, vc = d.new_cache(b, t)
    with torch.no_grad():
        logits, out = d(ids, hidden, pos, mask, kc, vc, pos)
        ref_logits, ref_out = eagle3_naive(d, emb.weight, ids, hidden, pos, mask, norm_before_residual=True)
        plain_logits, _ = eagle3_naive(d, emb.weight, ids, hidden, pos, mask)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(logits, plain_logits, atol=1e-2)


def test_block_conventions_set_the_label_shift():
    zlab = DFlashConfig.for_target(TARGET, block_size=4)
    deepspec = DFlashConfig.from_dict({**zlab.to_dict(), "convention": "deepspec"})
    assert (zlab.convention, zlab.label_shift) == ("z-lab", 0)
    assert deepspec.label_shift == 1 and DFlashDrafter(deepspec).num_drafts == 4
    assert DFlashDrafter(zlab).num_drafts == 3
    dspark = DSparkConfig.for_target(TARGET, block_size=3, markov_rank=4)
    assert dspark.convention == "deepspec" and DSparkDrafter(dspark).num_drafts == 3
    assert DFlashConfig.from_dict({**zlab.to_dict(), "convention": "deepspec", "block_size": 1}).label_shift == 1
    with pytest.raises(SpecrtError, match="gives no drafts"):
        DFlashConfig.from_dict({**zlab.to_dict(), "block_size": 1})
    with pytest.raises(SpecrtError, match="convention"):
        DFlashConfig.from_dict({**zlab.to_dict(), "convention": "medusa"})
    with pytest.raises(SpecrtError, match="DeepSpec's block convention"):
        DSparkConfig.from_dict({**dspark.to_dict(), "convention": "z-lab"})


def test_eagle3_cached_steps_equal_one_pass():
    d, _ = make_eagle3(seed=4)
    b, t = 2, 5
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(b, t, 32, generator=g)
    ids = torch.randint(0, 64, (b, t), generator=g)
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    with torch.no_grad():
        kc, vc = d.new_cache(b, t + 3)
        full_logits, full_out = d(ids, hidden, pos, mask, kc, vc, pos)
        kc, vc = d.new_cache(b, t + 3)
        kc.normal_()  # stale garbage in unused slots must not matter
        vc.normal_()
        for i in range(t):
            step_mask = torch.ones(b, 1, i + 1, dtype=torch.bool)
            logits, out = d(ids[:, i:i + 1], hidden[:, i:i + 1], pos[:, i:i + 1], step_mask, kc, vc, pos[:, i:i + 1])
            torch.testing.assert_close(logits[:, 0], full_logits[:, i], atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(out[:, 0], full_out[:, i], atol=1e-5, rtol=1e-5)


def test_eagle3_draft_vocab_map_and_embedding_binding():
    d, _ = make_eagle3()
    d.d2t.copy_(torch.arange(40) % 3)
    ids = torch.tensor([[0, 1, 2, 39]])
    assert d.draft_to_target(ids).tolist() == [[0, 2, 4, 39]]
    fresh = Eagle3Drafter(Eagle3Config.for_target(TARGET, 40))
    with pytest.raises(SpecrtError, match="bind_target_embedding"):
        fresh.embed(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(SpecrtError, match="embedding"):
        fresh.bind_target_embedding(torch.nn.Embedding(10, 32))
    own_cfg = {**Eagle3Config.for_target(TARGET, 40).to_dict(), "own_embedding": True}
    own = Eagle3Drafter(Eagle3Config.from_dict(own_cfg))
    assert "embed_tokens.weight" in own.state_dict()
    assert not own.embed_tokens.weight.requires_grad
    assert own.embed(torch.zeros(1, 2, dtype=torch.long)).shape == (1, 2, 32)


# ---------------------------------------------------------------------------------------------
# DFlash
# ---------------------------------------------------------------------------------------------
def make_target(seed=0, **kw) -> LlamaModel:
    cfg = LlamaConfig(**{**TARGET.to_dict(), **kw})
    t = LlamaModel(cfg)
    randomize(t, seed)
    return t.eval()


def make_dflash(cls=DFlashDrafter, seed=0, **kw):
    cfg_cls = DSparkConfig if cls is DSparkDrafter else DFlashConfig
    defaults = dict(num_layers=2, block_size=4, mask_token_id=63)
    if cls is DSparkDrafter:
        defaults["markov_rank"] = 8
    cfg = cfg_cls.for_target(TARGET, **{**defaults, **kw})
    d = cls(cfg)
    randomize(d, seed)
    target = make_target(seed + 10)
    d.bind_target(target.embed_tokens, target.lm_head)
    return d.eval(), target


def dflash_naive(d: DFlashDrafter, taps, ctx_pos, block_ids, block_pos):
    cfg = d.config
    eps = cfg.rms_norm_eps
    ctx = rms(F.linear(taps, d.fc.weight), d.hidden_norm.weight, eps)
    x = F.embedding(block_ids, d.target_embed_weight)
    for layer in d.layers:
        a = layer.self_attn
        xn = rms(x, layer.input_layernorm.weight, eps)

        def k_of(src, pos):
            k = heads(F.linear(src, a.k_proj.weight), cfg.num_kv_heads, cfg.head_dim)
            return rope(rms(k, a.k_norm.weight, eps), pos, cfg.rope_theta)

        q = heads(F.linear(xn, a.q_proj.weight), cfg.num_heads, cfg.head_dim)
        q = rope(rms(q, a.q_norm.weight, eps), block_pos, cfg.rope_theta)
        k = torch.cat([k_of(ctx, ctx_pos), k_of(xn, block_pos)], dim=2)  # [W_K H_ctx ; W_K H_block]
        v = torch.cat([heads(F.linear(ctx, a.v_proj.weight), cfg.num_kv_heads, cfg.head_dim),
                       heads(F.linear(xn, a.v_proj.weight), cfg.num_kv_heads, cfg.head_dim)], dim=2)
        o = naive_attention(q, k, v, None).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        x = x + F.linear(o, a.o_proj.weight)
        x = x + mlp(layer.mlp, rms(x, layer.post_attention_layernorm.weight, eps))
    h = rms(x, d.norm.weight, eps)
    return F.linear(h, d.target_lm_head_weight), h


@pytest.mark.parametrize("cls", [DFlashDrafter, DSparkDrafter])
def test_dflash_ingest_and_block_match_naive(cls):
    d, _ = make_dflash(cls, seed=5)
    cfg = d.config
    b, tc, bk = 2, 5, cfg.block_size
    m = len(cfg.tap_layers)
    g = torch.Generator().manual_seed(2)
    taps = torch.randn(b, tc, m * 32, generator=g)
    block = d.block_ids(torch.randint(0, 64, (b,), generator=g))
    assert block[:, 1:].eq(cfg.mask_token_id).all()
    ctx_pos = torch.arange(tc).expand(b, tc)
    block_pos = torch.arange(tc, tc + bk).expand(b, bk)
    cap = tc + bk + 4
    kc, vc = d.new_cache(b, cap)
    assert kc.shape == (2, b, 2, cap, 8)
    kc.normal_()
    vc.normal_()  # garbage in the gap slots must be masked out
    with torch.no_grad():
        # context ingested in two chunks (prompt, then accepted tokens), block at slots after a gap of 2
        d.ingest_context(taps[:, :3], ctx_pos[:, :3], kc, vc, ctx_pos[:, :3])
        d.ingest_context(taps[:, 3:], ctx_pos[:, 3:], kc, vc, ctx_pos[:, 3:])
        block_slots = torch.arange(tc + 2, tc + 2 + bk).expand(b, bk)
        mask = torch.zeros(b, bk, tc + 2 + bk, dtype=torch.bool)
        mask[:, :, :tc] = True
        mask[:, :, tc + 2:] = True
        logits, hidden = d(block, block_pos, mask, kc, vc, block_slots)
        ref_logits, ref_hidden = dflash_naive(d, taps, ctx_pos, block, block_pos)
    assert logits.shape == (b, bk, 64) and logits.dtype == torch.float32
    assert hidden.shape == (b, bk, 32)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)


def test_dflash_context_features_and_labels():
    d, _ = make_dflash()
    taps = torch.randn(1, 3, len(d.config.tap_layers) * 32)
    ref = rms(F.linear(taps, d.fc.weight), d.hidden_norm.weight, d.config.rms_norm_eps)
    torch.testing.assert_close(d.context_features(taps), ref)
    assert d.label_shift == 0 and d.num_drafts == d.config.block_size - 1
    s, _ = make_dflash(DSparkDrafter)
    assert s.label_shift == 1 and s.num_drafts == s.config.block_size
    unbound = DFlashDrafter(d.config)
    with pytest.raises(SpecrtError, match="bind_target"):
        unbound.embed(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(SpecrtError, match="LM head|embedding"):
        unbound.bind_target(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 50, bias=False))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_dflash_init_from_target(qk_norm):
    target = make_target(seed=1, qk_norm=qk_norm, model_type="qwen3" if qk_norm else "llama")
    d = DFlashDrafter(DFlashConfig.for_target(target.config, num_layers=2, block_size=4))
    randomize(d, 9)
    copied = d.init_from_target(target)
    assert "layers.0.self_attn.q_proj.weight" in copied and "norm.weight" in copied
    for mine, theirs in zip(d.layers, target.layers[-2:]):
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(mine.state_dict()[name], theirs.state_dict()[name]), name
        if qk_norm:
            assert torch.equal(mine.self_attn.q_norm.weight, theirs.self_attn.q_norm.weight)
        else:
            assert torch.equal(mine.self_attn.q_norm.weight, torch.ones(8))
            assert torch.equal(mine.self_attn.k_norm.weight, torch.ones(8))
    assert torch.equal(d.norm.weight, target.norm.weight)


# ---------------------------------------------------------------------------------------------
# DSpark
# ---------------------------------------------------------------------------------------------
def test_dspark_markov_and_confidence_math():
    d, _ = make_dflash(DSparkDrafter, seed=11, block_size=3)
    assert d.confidence_head.proj.bias is not None
    assert d.confidence_head.proj.weight.shape == (1, 32 + 8)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 64, generator=g)
    prev = torch.tensor([0, 5, 63, 7])
    hidden = torch.randn(4, 32, generator=g)
    w1, w2 = d.markov_w1.weight, d.markov_w2.weight
    ref = base + w1[prev] @ w2.T
    torch.testing.assert_close(d.markov_logits(base, prev), ref)
    w, bias = d.confidence_head.proj.weight[0], d.confidence_head.proj.bias[0]
    ref_z = torch.cat([hidden, w1[prev]], -1) @ w + bias
    z = d.confidence(hidden, prev)
    assert z.shape == (4,)
    torch.testing.assert_close(z, ref_z)
    d.sts_temperatures.copy_(torch.tensor([1.0, 2.0, 0.5]))
    zz = torch.randn(2, 3, generator=g)
    surv = d.survival(zz)
    ref_s = torch.sigmoid(zz / torch.tensor([1.0, 2.0, 0.5])).cumprod(-1)
    torch.testing.assert_close(surv, ref_s)


def _dspark_inputs(d, b=2, tc=4, seed=0):
    cfg = d.config
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(b, tc, len(cfg.tap_layers) * 32, generator=g)
    block = d.block_ids(torch.randint(0, 64, (b,), generator=g))
    ctx_pos = torch.arange(tc).expand(b, tc)
    bk = cfg.block_size
    block_pos = torch.arange(tc, tc + bk).expand(b, bk)
    mask = torch.ones(b, bk, tc + bk, dtype=torch.bool)
    kc, vc = d.new_cache(b, tc + bk)
    with torch.no_grad():
        d.ingest_context(taps, ctx_pos, kc, vc, ctx_pos)
    return block, block_pos, mask, kc, vc, block_pos


@pytest.mark.parametrize("variant", ["vanilla", "gated", "gru"])
def test_dspark_greedy_draft_is_the_argmax_chain(variant):
    d, _ = make_dflash(DSparkDrafter, seed=12, block_size=4, markov_variant=variant)
    block, pos, mask, kc, vc, slots = _dspark_inputs(d)
    with torch.no_grad():
        base, hidden = d(block, pos, mask, kc.clone(), vc.clone(), slots)
        tokens, probs, conf = d.draft(block, pos, mask, kc, vc, slots, temperature=0.0)
    assert tokens.shape == (2, 4) and probs is None and conf.shape == (2, 4)
    prev, state = block[:, 0], None
    for k in range(4):
        logits, state = d.markov_step(base[:, k], prev, hidden[:, k], state)
        if variant == "vanilla":
            torch.testing.assert_close(logits, base[:, k] + d.markov_w1(prev) @ d.markov_w2.weight.T)
        x = logits.argmax(-1)
        assert torch.equal(tokens[:, k], x)
        torch.testing.assert_close(conf[:, k], d.confidence(hidden[:, k], prev))
        prev = x
    # teacher-forced block logits (training) equal the step-by-step chain on the same prev tokens
    prevs = torch.cat([block[:, :1], tokens[:, :-1]], dim=1)
    block_logits = d.markov_block_logits(base, prevs, hidden)
    prev, state = block[:, 0], None
    for k in range(4):
        logits, state = d.markov_step(base[:, k], prevs[:, k], hidden[:, k], state)
        torch.testing.assert_close(block_logits[:, k], logits)


def test_dspark_sampled_draft_uses_the_generator():
    d, _ = make_dflash(DSparkDrafter, seed=13, block_size=3)
    block, pos, mask, kc, vc, slots = _dspark_inputs(d, seed=4)
    with torch.no_grad():
        base, hidden = d(block, pos, mask, kc.clone(), vc.clone(), slots)
        t1, p1, c1 = d.draft(block, pos, mask, kc.clone(), vc.clone(), slots, 0.7, torch.Generator().manual_seed(5))
        t2, p2, c2 = d.draft(block, pos, mask, kc.clone(), vc.clone(), slots, 0.7, torch.Generator().manual_seed(5))
    assert torch.equal(t1, t2) and torch.equal(p1, p2) and torch.equal(c1, c2)
    assert p1.shape == (2, 3, 64)
    torch.testing.assert_close(p1.sum(-1), torch.ones(2, 3))
    # probabilities follow the sampled chain: softmax((U_k + W2 W1[x_{k-1}]) / T)
    prev = block[:, 0]
    for k in range(3):
        ref = torch.softmax(d.markov_logits(base[:, k], prev) / 0.7, -1)
        torch.testing.assert_close(p1[:, k], ref)
        assert (p1[:, k].gather(1, t1[:, k:k + 1]) > 0).all()
        prev = t1[:, k]


def test_target_taps_feed_the_drafters():
    """The target's tap output (hidden_states indices) has exactly the width each drafter's fc reads."""
    target = make_target(seed=2)
    e, _ = make_eagle3()
    dfl, _ = make_dflash()
    b, t = 1, 4
    ids = torch.randint(0, 64, (b, t))
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    with torch.no_grad():
        for drafter in (e, dfl):
            target.set_taps(drafter.config.tap_layers)
            kc, vc = target.new_cache(b, t)
            _, taps = target(ids, pos, mask, kc, vc, pos)
            assert taps.shape[-1] == drafter.fc.in_features
        dk, dv = dfl.new_cache(b, t + dfl.config.block_size)
        dfl.ingest_context(taps, pos, dk, dv, pos)
        assert dk[:, :, :, :t].abs().sum() > 0 and dk[:, :, :, t:].abs().sum() == 0
