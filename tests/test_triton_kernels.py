"""specrt's Triton kernels against the torch references: TreeAttention, the K/V row write, ConfidenceTruncate.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is imported); with CUDA they run natively on the GPU. Shapes are small so the whole
file takes seconds in the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from specrt.plugins.confidence_truncate import confidence_truncate_reference, sps_vector  # noqa: E402
from specrt.plugins.tree_attention import tree_attention_reference  # noqa: E402
from specrt.plugins.triton_confidence_truncate import confidence_truncate  # noqa: E402
from specrt.plugins.triton_tree_attention import tree_attention, write_kv  # noqa: E402
from specrt.runtime.backends.ort_models import write_new_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_tree(g: torch.Generator, batch: int, t: int) -> torch.Tensor:
    """Ancestor-or-self masks of random trees (node i's parent is some j < i)."""
    mask = torch.zeros(batch, t, t, dtype=torch.bool)
    for b in range(batch):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, t)]
        for i, p in enumerate(parents):
            mask[b, i, i] = True
            while p >= 0:
                mask[b, i, p] = True
                p = parents[p]
    return mask


def attention_case(seed: int, dtype: torch.dtype):
    """Random shapes: decode (T = 1) or tree verify, GQA groups 1-4, cache fill levels 0..capacity."""
    g = torch.Generator().manual_seed(seed)
    b = 1 + seed % 2
    hkv = [1, 2, 3][seed % 3]
    group = [1, 3, 2, 4][seed % 4]
    t = 1 if seed % 3 == 0 else 2 + seed % 6
    d = [16, 8, 32, 64][seed % 4]
    capacity = 8 + (seed * 7) % 40
    window = [0, capacity, capacity // 2, 1 + seed % capacity][seed % 4]  # empty, full, half, random fill

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    lengths = torch.randint(0, window + 1, (b,), generator=g)
    past_mask = (torch.arange(window)[None, None, :] < lengths[:, None, None]).expand(b, t, window).clone()
    # a sprinkle of holes, as padding rows produce
    past_mask &= torch.rand(b, t, window, generator=g) > 0.1
    tree = random_tree(g, b, t)
    args = (rnd(b, hkv * group, t, d), rnd(b, hkv, t, d), rnd(b, hkv, t, d), rnd(b, hkv, capacity, d),
            rnd(b, hkv, capacity, d), past_mask, tree)
    return args, 1.0 / d ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("seed", range(8))
def test_triton_tree_attention_matches_reference(seed, dtype):
    args, scale = attention_case(seed, dtype)
    ref = tree_attention_reference(*args, scale=scale)
    out = tree_attention(*(a.to(DEVICE) for a in args), scale=scale)
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float().cpu() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max diff {err}"


def test_triton_tree_attention_fully_masked_rows_are_zero():
    args, scale = attention_case(5, torch.float32)
    q, k, v, pk, pv, past_mask, tree = args
    past_mask[0, 1] = False
    tree[0, 1] = False  # row 1 of batch 0 sees nothing at all
    out = tree_attention(q, k, v, pk, pv, past_mask, tree, scale=scale).cpu()
    assert torch.isfinite(out).all()
    assert out[0, :, 1].abs().max().item() == 0.0
    assert (out - tree_attention_reference(q, k, v, pk, pv, past_mask, tree, scale)).abs().max().item() <= 2e-5


def test_triton_tree_attention_reads_cache_views_in_place():
    """past_key/past_value as views of one [L, B, Hkv, C, D] cache (what the backends bind), batch 2."""
    g = torch.Generator().manual_seed(11)
    layers, b, hkv, c, d, t = 3, 2, 2, 20, 16, 3
    k_cache, v_cache = torch.randn(layers, b, hkv, c, d, generator=g), torch.randn(layers, b, hkv, c, d, generator=g)
    q = torch.randn(b, 2 * hkv, t, d, generator=g)
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    past = torch.ones(b, t, 13, dtype=torch.bool)
    past[1, :, 9:] = False
    tree = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t).clone()
    got = tree_attention(q, k, v, k_cache[1], v_cache[1], past, tree, 0.25)
    want = tree_attention_reference(q, k, v, k_cache[1].clone(), v_cache[1].clone(), past, tree, 0.25)
    assert (got - want).abs().max().item() <= 2e-5
    # and a transposed (non-contiguous) query view gives the same numbers
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(tree_attention(qt, k, v, k_cache[1], v_cache[1], past, tree, 0.25), got)


def test_triton_tree_attention_refuses_bad_shapes():
    from specrt.plugins.errors import SpecrtError

    q, k, v = torch.randn(1, 3, 2, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16)
    pk, pv = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    past, tree = torch.ones(1, 2, 5, dtype=torch.bool), torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(SpecrtError, match="not a multiple"):
        tree_attention(q, k, v, pk, pv, past, tree, 0.25)
    with pytest.raises(SpecrtError, match="tree_mask"):
        tree_attention(q[:, :2], k, v, pk, pv, past, tree[:, :, :1], 0.25)
    with pytest.raises(SpecrtError, match="past_mask"):
        tree_attention(q[:, :2], k, v, pk, pv, torch.ones(1, 2, 6, dtype=torch.bool), tree, 0.25)


@pytest.mark.parametrize("seed", range(4))
def test_triton_kv_write_matches_index_copy(seed):
    g = torch.Generator().manual_seed(seed)
    layers, b, h, c, t, d = 2 + seed % 2, 1 + seed % 3, 2, 24, 1 + seed * 2, 16
    k_cache, v_cache = torch.randn(layers, b, h, c, d, generator=g), torch.randn(layers, b, h, c, d, generator=g)
    new_k, new_v = torch.randn(layers, b, h, t, d, generator=g), torch.randn(layers, b, h, t, d, generator=g)
    lengths = torch.randint(0, c - t + 1, (b,), generator=g)
    slots = lengths[:, None] + torch.arange(t)[None, :]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_new_kv(want_k, want_v, new_k, new_v, slots)
    kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv(kc, vc, new_k.to(DEVICE), new_v.to(DEVICE), slots)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


def test_triton_kv_write_skips_negative_slots_and_keeps_first_duplicate():
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(1, 2, 1, 8, 16, generator=g), torch.randn(1, 2, 1, 8, 16, generator=g)
    new_k, new_v = torch.randn(1, 2, 1, 4, 16, generator=g), torch.randn(1, 2, 1, 4, 16, generator=g)
    slots = torch.tensor([[2, 3, 3, 3], [-1, 5, -1, 6]])  # row 0: padding repeats slot 3; row 1: rejected rows
    before_k = k_cache.clone()
    write_kv(k_cache, v_cache, new_k, new_v, slots)
    assert torch.equal(k_cache[0, 0, 0, 3], new_k[0, 0, 0, 1])  # the first token naming slot 3 wins
    assert torch.equal(k_cache[0, 1, 0, 5], new_k[0, 1, 0, 1]) and torch.equal(v_cache[0, 1, 0, 6], new_v[0, 1, 0, 3])
    untouched = [s for s in range(8) if s not in (5, 6)]
    assert torch.equal(k_cache[0, 1, 0, untouched], before_k[0, 1, 0, untouched])
    # 4-D caches (one layer, no L axis) work the same
    k4, v4 = before_k[0].clone(), v_cache[0].clone()
    write_kv(k4, v4, new_k[0], new_v[0], slots)
    assert torch.equal(k4, k_cache[0])


def confidence_case(seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    b, k = 1 + seed % 4, 1 + (seed * 3) % 7
    z = torch.randn(b, k, generator=g) * 3 + 1
    temps = 0.5 + torch.rand(k + seed % 3, generator=g)
    threshold = torch.tensor(float(torch.rand(1, generator=g)) * 0.5 if seed % 2 else 0.0)
    if seed % 3 == 0:
        sps = torch.ones(1)  # threshold policy
    else:  # SPS policy over a profiled-looking curve, sometimes shorter than the candidates
        sps = sps_vector(lambda n: 100.0 / (1 + 0.05 * n ** 1.3), b * k + 3 - seed % 5)
    return z, temps, threshold, sps


def test_triton_confidence_truncate_matches_reference():
    lengths_seen = set()
    for seed in range(30):
        z, temps, threshold, sps = confidence_case(seed)
        survival, length = confidence_truncate(*(x.to(DEVICE) for x in (z, temps, threshold, sps)))
        want_s, want_l = confidence_truncate_reference(z, temps, threshold, sps)
        assert survival.dtype == torch.float32 and length.dtype == torch.int64
        assert (survival.cpu() - want_s).abs().max().item() <= 1e-6, seed
        assert torch.equal(length.cpu(), want_l), (seed, length.tolist(), want_l.tolist())
        lengths_seen.update(want_l.tolist())
    assert len(lengths_seen) >= 4  # the cases exercise more than one outcome


def test_triton_confidence_truncate_float16_inputs():
    z, temps, threshold, sps = confidence_case(4)
    survival, length = confidence_truncate(z.half().to(DEVICE), temps.half().to(DEVICE), threshold.half().to(DEVICE),
                                           sps.half().to(DEVICE))
    want_s, _ = confidence_truncate_reference(z.half(), temps.half(), threshold.half(), sps.half())
    assert (survival.cpu() - want_s).abs().max().item() <= 1e-5
