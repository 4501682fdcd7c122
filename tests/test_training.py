"""Drafter training on a tiny random target and a tiny data set written here in the build_data
shard format: the feature cache, the objectives' masks against direct computation, the three
trainers (learning, checkpoints, lossless drafting, resume), the draft vocabulary and STS."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from specrt.export.checkpoints.drafters import load_drafter
from specrt.plugins.errors import SpecrtError
from specrt.export.models import LlamaConfig, LlamaModel
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.generate import generate_autoregressive
from specrt.runtime.proposers.block import BlockProposer
from specrt.runtime.proposers.eagle3 import Eagle3Proposer
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import generate_speculative
from specrt.tools import calibrate_sts, dflash_blocks, train_dflash, train_eagle3
from specrt.tools.train_features import FeatureStore, ensure_features, is_validation

VOCAB = 61
NUM_SAMPLES = 40  # ids s0..s39: s39 is the held-out one (sha256 split)


def tiny_target(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=8, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=512, rope_theta=10000.0)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: a learnable greedy continuation
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def write_dataset(folder: Path, target: LlamaModel, num: int = NUM_SAMPLES, new_tokens: int = 14,
                  prefix: str = "s", seed: int = 0) -> Path:
    """Random prompts, responses = the target's greedy continuation, two shards."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB - 1, size=int(rng.integers(3, 9))).tolist() for _ in range(num)]
    engine = TorchTargetEngine(target, 64, num)
    responses = generate_autoregressive(engine, prompts, new_tokens, SamplingParams()).tokens
    folder.mkdir(parents=True, exist_ok=True)
    half = num // 2
    for shard, (lo, hi) in enumerate(((0, half), (half, num))):
        payload = {"ids": [f"{prefix}{i}" for i in range(lo, hi)], "prompt": prompts[lo:hi], "response": responses[lo:hi]}
        (folder / f"shard_{shard:05d}.json.gz").write_bytes(gzip.compress(json.dumps(payload).encode()))
    return folder


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread avoids the synchronisation cost of two (and a busy machine's oversubscription)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def data(tmp_path_factory, target):
    return write_dataset(tmp_path_factory.mktemp("data") / "tiny", target)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


def full_forward(model: LlamaModel, ids: list[int], taps) -> torch.Tensor:
    t = len(ids)
    model.set_taps(taps)
    k, v = model.new_cache(1, t)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        _, out = model(torch.tensor([ids]), pos, torch.tril(torch.ones(t, t, dtype=torch.bool))[None], k, v, pos)
    model.set_taps(())
    return out[0]


# -- feature cache --------------------------------------------------------------------------------
def test_feature_cache_round_trip_and_resume(tmp_path, target, data, monkeypatch):
    import specrt.tools.train_features as tf

    taps = [2, 5]
    partial = ensure_features(data, target, taps, cache_dir=tmp_path / "f", batch_tokens=64, max_batches=2,
                              progress=False)
    assert not partial.complete and partial.meta["batches_done"] == 2
    forwards = []
    real = tf._forward_taps
    monkeypatch.setattr(tf, "_forward_taps", lambda model, seqs: forwards.append(len(seqs)) or real(model, seqs))
    store = ensure_features(data, target, taps, cache_dir=tmp_path / "f", batch_tokens=64, progress=False)
    assert store.complete and store.meta["batches_done"] == store.meta["num_batches"] > 2
    assert len(forwards) == store.meta["num_batches"] - 2  # resumed: the finished batches are not redone
    assert sum(forwards) == NUM_SAMPLES - sum(len(b) for b in tf.plan_batches(store.lengths.tolist(), 64)[:2])
    monkeypatch.undo()
    assert store.tap_layers == [2, 5, 8] and len(store) == NUM_SAMPLES
    assert list(store.val_indices) == [i for i in range(NUM_SAMPLES) if is_validation(f"s{i}")] == [39]
    assert target.tap_layers == ()  # the target's own taps are restored
    from specrt.tools.build_data import read_shards

    samples = read_shards(data)
    for i in (0, 17, 39):
        seq = samples[i]["prompt"] + samples[i]["response"]
        assert store.tokens(i).tolist() == seq and store.prompt_lengths[i] == len(samples[i]["prompt"])
        direct = full_forward(target, seq, [2, 5, 8])
        got = torch.from_numpy(store.taps(i, [2, 5, 8]).astype(np.float32))
        torch.testing.assert_close(got, direct, atol=2e-2, rtol=2e-3)  # fp16 storage
        torch.testing.assert_close(torch.from_numpy(store.hidden(i, 8).astype(np.float32)), direct[:, 64:],
                                   atol=2e-2, rtol=2e-3)
    # a complete cache is reused as is; a missing tap rebuilds it with the union of the taps
    again = ensure_features(data, target, [5], cache_dir=tmp_path / "f", progress=False)
    assert again.meta["seconds"] == store.meta["seconds"]
    wider = ensure_features(data, target, [3], cache_dir=tmp_path / "f", progress=False)
    assert wider.tap_layers == [2, 3, 5, 8]
    fb = wider.batch([0, 1], [3, 5])
    assert fb.taps.shape == (2, int(max(wider.lengths[:2])), 64) and fb.last.shape[-1] == 32
    assert FeatureStore(tmp_path / "f").complete


def test_several_data_sets_are_one_store(tmp_path, target, data, cache):
    from specrt.tools.train_common import feature_store
    from specrt.tools.train_features import ConcatFeatureStore

    other = write_dataset(tmp_path / "other", target, num=30, new_tokens=9, prefix="o", seed=1)
    args = train_eagle3.parse_args(common_args(tmp_path / "run", data, cache, 1, "--draft-vocab-size", "40",
                                               "--intermediate-size", "48", "--data", str(data), str(other)))
    assert args.data == [data, other]
    store = feature_store(args, target, [2, 5])
    assert isinstance(store, ConcatFeatureStore) and len(store) == NUM_SAMPLES + 30 and store.complete
    first = ensure_features(data, target, [2, 5], cache_dir=cache / dataset_hash_prefix(data), progress=False)
    second = ensure_features(other, target, [2, 5], cache_dir=cache / dataset_hash_prefix(other), progress=False)
    for i, (part, j) in {0: (first, 0), 39: (first, 39), 40: (second, 0), 69: (second, 29)}.items():
        assert store.tokens(i).tolist() == part.tokens(j).tolist()
        assert store.response(i).tolist() == part.response(j).tolist()
        assert np.array_equal(store.taps(i, [2, 5]), part.taps(j, [2, 5]))
    fb = store.batch([39, 40], [2, 5])  # one batch across both sets
    assert fb.lengths.tolist() == [first.lengths[39], second.lengths[0]]
    assert torch.equal(fb.taps[1, : second.lengths[0]], torch.from_numpy(second.taps(0, [2, 5]).astype(np.float32)))
    assert sorted(store.train_indices.tolist() + store.val_indices.tolist()) == list(range(70))
    held = [int(i) for i in second.val_indices + NUM_SAMPLES]
    assert held, "the second set should hold some samples out"
    # interleaved: the first held-out samples cover both sets
    assert store.val_indices.tolist()[:2] == [39, held[0]]
    res = train_eagle3.run(args, target)  # a trainer on both sets (2 steps)
    assert res["summary"]["train_samples"] == 70 - len(store.val_indices) and res["result"].step == 1
    args.data = [data, data]
    with pytest.raises(SpecrtError, match="twice"):
        feature_store(args, target, [2, 5])


def dataset_hash_prefix(folder: Path) -> str:
    from specrt.tools.train_features import dataset_hash

    return dataset_hash(folder)[:16]


# -- EAGLE-3 ---------------------------------------------------------------------------------------
def test_draft_vocab_frequency_order_and_maps():
    responses = [[5, 5, 5, 9, 9, 2], [9, 7, 5, 2, 2, 1]]  # counts: 5:4, 9:3, 2:3, 7:1, 1:1
    vocab = train_eagle3.build_draft_vocab(responses, 3, 12)
    assert vocab.tokens.tolist() == [2, 5, 9]  # top 3 by count (2 before 9 on a tie? both 3: lower id first)
    assert torch.equal(torch.arange(3) + vocab.d2t, vocab.tokens)
    assert vocab.t2d.sum() == 3 and vocab.t2d[[2, 5, 9]].all()
    assert abs(vocab.coverage - 10 / 12) < 1e-9
    tie = train_eagle3.build_draft_vocab(responses, 4, 12)
    assert tie.tokens.tolist() == [1, 2, 5, 9]  # 1 and 7 tie at one count: the lower id wins
    filled = train_eagle3.build_draft_vocab([[3, 3]], 3, 8)
    assert filled.tokens.tolist() == [0, 1, 3] and filled.coverage == 1.0
    # the drafter maps draft ids back through d2t
    drafter = Eagle3Drafter(Eagle3Config.for_target(tiny_target().config, 4))
    drafter.d2t.copy_(tie.d2t)
    assert drafter.draft_to_target(torch.arange(4)).tolist() == [1, 2, 5, 9]


def test_ttt_equals_step_by_step_drafting(target):
    """Row j at TTT step i equals the runtime path: context rows 0..j, then a chain of i nodes."""
    torch.manual_seed(3)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, VOCAB)).eval()
    drafter.bind_target_embedding(target.embed_tokens)
    n, steps = 12, 4
    tokens = torch.randint(0, VOCAB, (2, n))
    lengths = torch.tensor([n, n - 3])
    fused = torch.randn(2, n - 1, 32)
    start = torch.tensor([1, 0])
    rows = 6
    with torch.no_grad():
        outs = train_eagle3.ttt_forward(drafter, fused, tokens, lengths, start, rows, steps)
    for b, j in ((0, 1), (0, 5), (1, 3)):
        r = j - int(start[b])
        k, v = drafter.new_cache(1, 32)
        ctx = torch.arange(j + 1)[None]
        mask = torch.tril(torch.ones(j + 1, j + 1, dtype=torch.bool))[None]
        with torch.no_grad():
            _, out = drafter(tokens[b:b + 1, 1:j + 2], fused[b:b + 1, :j + 1], ctx, mask, k, v, ctx)
            hidden = out[:, -1:]
            torch.testing.assert_close(outs[0][b, r], hidden[0, 0], atol=1e-5, rtol=1e-5)
            for i in range(1, steps):
                slot = torch.tensor([[j + i]])
                mask = torch.ones(1, 1, j + i + 1, dtype=torch.bool)
                _, hidden = drafter(tokens[b:b + 1, j + 1 + i:j + 2 + i], hidden, slot, mask, k, v, slot)
                torch.testing.assert_close(outs[i][b, r], hidden[0, 0], atol=1e-5, rtol=1e-5)


def test_ttt_attention_equals_the_extended_mask():
    torch.manual_seed(0)
    b, hq, hkv, r, t, d, steps = 2, 4, 2, 5, 7, 8, 3
    q = torch.randn(b, hq, r, d)
    k0, v0 = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    mask0 = torch.rand(b, r, t) > 0.4
    mask0[..., 0] = True
    dk = [torch.randn(b, hkv, r, d) for _ in range(steps)]
    dv = [torch.randn(b, hkv, r, d) for _ in range(steps)]
    got = train_eagle3.ttt_attention(q, k0, v0, mask0, dk, dv)
    from specrt.export.models.layers import masked_attention

    keys = torch.cat([k0] + dk, dim=2)
    values = torch.cat([v0] + dv, dim=2)
    eye = torch.eye(r, dtype=torch.bool)[None].expand(b, r, r)
    mask = torch.cat([mask0] + [eye] * steps, dim=-1)
    torch.testing.assert_close(got, masked_attention(q, keys, values, mask), atol=1e-5, rtol=1e-5)


# -- DFlash / DSpark -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_packed_blocks_equal_one_block_at_a_time(target, kind):
    torch.manual_seed(4)
    if kind == "dflash":
        drafter = DFlashDrafter(DFlashConfig.for_target(target.config, num_layers=2, block_size=4, num_taps=3))
    else:
        drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=2, block_size=3, num_taps=3,
                                                        markov_rank=8))
    drafter.bind_target(target.embed_tokens, target.lm_head)
    drafter.eval()
    n, bk = 14, drafter.config.block_size
    taps = torch.randn(2, n, 3 * 32)
    tokens = torch.randint(0, VOCAB, (2, n))
    anchors = torch.tensor([[3, 4, 9], [6, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    mask = dflash_blocks.block_attention_mask(anchors, valid, n, bk)
    # direct computation of the mask
    for b in range(2):
        for q in range(3 * bk):
            blk = q // bk
            for s in range(n + 3 * bk):
                ctx = s < n and bool(valid[b, blk]) and s < int(anchors[b, blk])
                own = s >= n and (s - n) // bk == blk
                assert bool(mask[b, q, s]) == (ctx or own)
    with torch.no_grad():
        packed = dflash_blocks.packed_block_hidden(drafter, taps, tokens, anchors, valid)
        for b, blk in ((0, 0), (0, 1), (0, 2), (1, 0)):
            a = int(anchors[b, blk])
            k, v = drafter.new_cache(1, 32)
            pos = torch.arange(a)[None]
            drafter.ingest_context(taps[b:b + 1, :a], pos, k, v, pos)  # the runtime: context < anchor
            ids = drafter.block_ids(tokens[b, a:a + 1])
            bpos = (a + torch.arange(bk))[None]
            window = a + bk
            m = torch.ones(1, bk, window, dtype=torch.bool)
            _, hidden = drafter(ids, bpos, m, k, v, bpos)
            torch.testing.assert_close(packed[b, blk], hidden[0], atol=1e-5, rtol=1e-5)
    labels, pos, lmask = dflash_blocks.block_labels(tokens, torch.tensor([n, 8]), anchors, valid, bk,
                                                   drafter.label_shift)
    shift = drafter.label_shift
    assert torch.equal(labels[0, 0], tokens[0, 3 + shift:3 + shift + bk])
    assert lmask[0, 0].tolist() == [shift >= 1] + [True] * (bk - 1)
    assert lmask[1, 0].tolist() == [(k + shift >= 1) and 6 + k + shift <= 7 for k in range(bk)]
    assert not lmask[1, 1:].any()


def test_anchors_lie_in_the_response():
    gen = torch.Generator().manual_seed(0)
    prompts, lengths = torch.tensor([5, 3, 9]), torch.tensor([12, 5, 10])
    anchors, valid = dflash_blocks.sample_anchors(prompts, lengths, 4, gen)
    assert valid.sum(1).tolist() == [4, 1, 0]
    for b in range(3):
        a = anchors[b][valid[b]]
        assert (a >= prompts[b]).all() and (a <= lengths[b] - 2).all() and len(set(a.tolist())) == len(a)
    w = dflash_blocks.position_weights(16, 0, 7.0)
    assert w[0] == 0 and w[1] == 1 and abs(float(w[15]) - float(np.exp(-2))) < 1e-6
    w = dflash_blocks.position_weights(7, 1, 4.0)
    assert w[0] == 1 and abs(float(w[6]) - float(np.exp(-1.5))) < 1e-6


# -- STS ---------------------------------------------------------------------------------------------
def test_sts_lowers_the_ece_of_an_overconfident_head():
    rng = np.random.default_rng(0)
    n, k = 6000, 4
    true_logits = rng.normal(1.0, 1.5, size=(n, k))
    accepted = rng.random((n, k)) < 1 / (1 + np.exp(-true_logits))
    survived = np.cumprod(accepted, axis=1).astype(float)
    z = 3.0 * true_logits  # overconfident: the right temperature is 3
    temps, before, after = calibrate_sts.fit_sts(z, survived)
    assert (after < before).all() and after.max() < 0.03 < before.min()
    assert all(2.0 < t < 4.5 for t in temps)
    assert set(np.round(np.log2(temps) * 10).astype(int)) <= set(range(-30, 31))  # on the grid
    pooled_before = calibrate_sts.expected_calibration_error(calibrate_sts.survival_probs(z, np.ones(k)), survived)
    pooled_after = calibrate_sts.expected_calibration_error(calibrate_sts.survival_probs(z, temps), survived)
    assert pooled_after < pooled_before / 3
    # a calibrated head keeps T = 1 (ties go to 1) or close to it
    temps_ok, _, _ = calibrate_sts.fit_sts(true_logits, survived)
    assert all(0.7 < t < 1.45 for t in temps_ok)


# -- the trainers end to end -------------------------------------------------------------------------
def common_args(out: Path, data: Path, cache: Path, steps: int, *extra: str) -> list[str]:
    return ["--data", str(data), "--out", str(out), "--cache-dir", str(cache), "--steps", str(steps),
            "--no-progress", "--val-samples", "4", "--eval-every", "1000", "--save-every", "5",
            "--precision", "fp32", *extra]  # fp32 unless a test asks: the numbers must not depend on the CPU


def first_last(history, k=5):
    losses = [r["loss"] for r in history["train"]]
    return float(np.mean(losses[:k])), float(np.mean(losses[-k:]))


def assert_lossless(target, proposer, n=24):
    prompts = [[5, 9, 13, 2], [11, 3, 7]]
    expected = generate_autoregressive(TorchTargetEngine(target, 96, 2), prompts, n, SamplingParams()).tokens
    got = generate_speculative(TorchTargetEngine(target, 96, 2), proposer, prompts, n, SamplingParams()).tokens
    assert got == expected
    return got


def test_eagle3_trainer(tmp_path, target, data, cache):
    out = tmp_path / "eagle3"
    args = train_eagle3.parse_args(common_args(out, data, cache, 40, "--draft-vocab-size", "40",
                                               "--intermediate-size", "48", "--lr", "3e-3", "--batch-size", "4"))
    res = train_eagle3.run(args, target)
    first, last = first_last(res["result"].history)
    assert last < 0.7 * first, (first, last)
    val = res["result"].last_eval
    assert len(val["acc"]) == 7 and len(val["kl"]) == 7
    for name in ("losses.csv", "loss_curve.png", "train_state.pt", "summary.json", "drafter/config.json"):
        assert (out / name).exists(), name
    drafter = load_drafter(out / "drafter", target.config)
    assert isinstance(drafter, Eagle3Drafter) and drafter.config.draft_vocab_size == 40
    store = res["store"]
    vocab = train_eagle3.build_draft_vocab((store.response(i) for i in store.train_indices), 40, VOCAB)
    assert torch.equal(drafter.d2t, vocab.d2t) and torch.equal(drafter.t2d, vocab.t2d)
    drafter.bind_target_embedding(target.embed_tokens)
    assert_lossless(target, Eagle3Proposer(drafter, top_k=3, depth=4, total_tokens=10))


def test_eagle3_resume_keeps_its_draft_vocabulary(tmp_path, target, data, cache, monkeypatch):
    """A resumed run keeps the vocabulary its head rows were trained for, even if the data would now
    rank other tokens first (the data set grew); a size that does not match is refused."""
    out = tmp_path / "eagle3"
    base = ["--draft-vocab-size", "40", "--intermediate-size", "48", "--batch-size", "4"]
    first = train_eagle3.run(train_eagle3.parse_args(common_args(out, data, cache, 4, *base, "--stop-at-step", "2")),
                             target)
    started = first["drafter"].d2t.clone()
    # the data "grew": a vocabulary built now would be another one
    monkeypatch.setattr(train_eagle3, "build_draft_vocab", lambda *a: pytest.fail("vocabulary rebuilt on resume"))
    resumed = train_eagle3.run(train_eagle3.parse_args(common_args(out, data, cache, 4, *base, "--resume")), target)
    assert resumed["result"].step == 4
    assert torch.equal(resumed["drafter"].d2t, started)
    with pytest.raises(SpecrtError, match="draft vocabulary has 40 tokens"):
        train_eagle3.run(train_eagle3.parse_args(common_args(out, data, cache, 6, "--draft-vocab-size", "30",
                                                             "--intermediate-size", "48", "--resume")), target)


def test_remap_head_rows_carries_trained_rows_and_moments(target):
    """Rows of tokens both vocabularies hold move with their Adam moments; new rows are the target's
    LM-head rows with zero moments; d2t/t2d describe the new vocabulary."""
    from specrt.tools.train_common import make_optimizer, optimizer_slots

    size = 40  # more rows than hidden size + 1, so the head-space map is determined by the old rows
    cfg = Eagle3Config.for_target(target.config, size, intermediate_size=48)
    drafter = Eagle3Drafter(cfg)
    old_tokens = list(range(1, 41))
    old = train_eagle3.vocab_from_tokens(torch.tensor(old_tokens), VOCAB, 1.0, 1)
    drafter.d2t.copy_(old.d2t)
    drafter.t2d.copy_(old.t2d)
    # a trained head that drifted from the target's as a whole: scaled and shifted target rows
    shift = torch.linspace(-1, 1, target.config.hidden_size)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(0.5 * target.lm_head.weight[old_tokens] + shift)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = make_optimizer(params, 1e-2, 0.0)
    sum((p.float() ** 2).sum() for p in params).backward()
    state = {"model": {k: v.clone() for k, v in drafter.state_dict().items()}, "optimizer": opt.state_dict()}
    slot = optimizer_slots(drafter).index("lm_head.weight")
    opt.step()  # moments exist after a step; the state above holds the weights before it
    state["optimizer"] = opt.state_dict()
    old_m = state["optimizer"]["state"][slot]["exp_avg"].clone()
    old_w = state["model"]["lm_head.weight"].clone()

    new = train_eagle3.vocab_from_tokens(torch.arange(11, 51), VOCAB, 1.0, 1)
    kept, fresh = train_eagle3.remap_head_rows(state, optimizer_slots(drafter), old_tokens, new,
                                               target.lm_head.weight)
    assert (kept, fresh) == (30, 10)
    w, m = state["model"]["lm_head.weight"], state["optimizer"]["state"][slot]["exp_avg"]
    for j, tok in enumerate(new.tokens.tolist()):
        if tok in old_tokens:
            i = old_tokens.index(tok)
            assert torch.equal(w[j], old_w[i]) and torch.equal(m[j], old_m[i])
        else:
            # the new row went through the fitted map: scaled and shifted like the trained ones
            want = 0.5 * target.lm_head.weight[tok] + shift
            assert torch.allclose(w[j], want, atol=0.05), (w[j] - want).abs().max()
            assert not m[j].any()
    assert torch.equal(state["model"]["d2t"] + torch.arange(size), new.tokens)
    assert state["model"]["t2d"].nonzero().flatten().tolist() == new.tokens.tolist()
    assert state["extra"]["draft_vocab_tokens"] == new.tokens.tolist()
    drafter.load_state_dict(state["model"])  # the edited state still fits the model and its optimizer
    opt.load_state_dict(state["optimizer"])


def test_eagle3_resume_remaps_a_stale_draft_vocabulary(tmp_path, target, data, cache, monkeypatch):
    """--remap-vocab: a run started on a vocabulary the data no longer ranks first resumes on the one
    it ranks now, keeps the old state beside, trains on and drafts losslessly; without a run it is refused."""
    out = tmp_path / "eagle3"
    base = ["--draft-vocab-size", "30", "--intermediate-size", "48", "--batch-size", "4"]
    real = train_eagle3.build_draft_vocab
    with monkeypatch.context() as m:  # the run "started" on the least frequent tokens
        m.setattr(train_eagle3, "build_draft_vocab",
                  lambda responses, size, vocab: train_eagle3.vocab_from_tokens(torch.arange(VOCAB - size, VOCAB),
                                                                                 vocab, 0.0, 0))
        train_eagle3.run(train_eagle3.parse_args(common_args(out, data, cache, 6, *base, "--stop-at-step", "2")),
                         target)
    resumed = train_eagle3.run(train_eagle3.parse_args(
        common_args(out, data, cache, 6, *base, "--resume", "--remap-vocab")), target)
    store = resumed["store"]
    want = real((store.response(i) for i in store.train_indices), 30, VOCAB)
    assert torch.equal(resumed["drafter"].d2t, want.d2t) and resumed["result"].step == 6
    assert (out / "train_state.pre_remap.pt").exists()
    assert resumed["summary"]["draft_vocab_coverage"] == pytest.approx(want.coverage)
    drafter = load_drafter(out / "drafter", target.config)
    drafter.bind_target_embedding(target.embed_tokens)
    assert_lossless(target, Eagle3Proposer(drafter, top_k=3, depth=4, total_tokens=10))
    with pytest.raises(SpecrtError, match="none to resume"):
        train_eagle3.run(train_eagle3.parse_args(common_args(tmp_path / "fresh", data, cache, 2, *base,
                                                             "--remap-vocab")), target)


def test_eagle3_init_from_a_saved_drafter(tmp_path, target, data, cache, monkeypatch, capsys):
    """--init-from: a fresh run starts from a saved drafter (its training state gone): every weight
    loaded, the head moved onto this run's vocabulary, then it trains on and drafts losslessly; a
    drafter of another width is refused with the flag that fits it."""
    base = ["--draft-vocab-size", "30", "--intermediate-size", "48", "--batch-size", "4"]
    with monkeypatch.context() as m:  # the saved drafter was trained on another vocabulary
        m.setattr(train_eagle3, "build_draft_vocab",
                  lambda responses, size, vocab: train_eagle3.vocab_from_tokens(torch.arange(VOCAB - size, VOCAB),
                                                                                 vocab, 0.0, 0))
        train_eagle3.run(train_eagle3.parse_args(common_args(tmp_path / "old", data, cache, 3, *base)), target)
    saved = load_drafter(tmp_path / "old" / "drafter", target.config)
    args = train_eagle3.parse_args(common_args(tmp_path / "new", data, cache, 4, *base,
                                               "--init-from", str(tmp_path / "old" / "drafter")))
    drafter, vocab = train_eagle3.build_drafter(args, target, _store(args, target))
    kept, new = train_eagle3.init_from_drafter(drafter, vocab, args.init_from, target)
    old_tokens = (saved.d2t + torch.arange(30)).tolist()
    assert kept == len(set(old_tokens) & set(vocab.tokens.tolist())) and kept + new == 30
    for name, tensor in saved.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(drafter.state_dict()[name], tensor.float()), name
    assert torch.equal(drafter.d2t, vocab.d2t)
    for j, tok in enumerate(vocab.tokens.tolist()):
        if tok in old_tokens:
            assert torch.equal(drafter.lm_head.weight[j], saved.lm_head.weight[old_tokens.index(tok)].float())
    res = train_eagle3.run(args, target)
    assert "--init-from" in capsys.readouterr().err and res["result"].step == 4
    trained = load_drafter(tmp_path / "new" / "drafter", target.config)
    trained.bind_target_embedding(target.embed_tokens)
    assert_lossless(target, Eagle3Proposer(trained, top_k=3, depth=4, total_tokens=10))
    wide = train_eagle3.parse_args(common_args(tmp_path / "wide", data, cache, 2, "--draft-vocab-size", "30",
                                               "--intermediate-size", "64", "--init-from",
                                               str(tmp_path / "old" / "drafter")))
    with pytest.raises(SpecrtError, match="--intermediate-size 48"):
        train_eagle3.run(wide, target)


def _store(args, target):
    from specrt.tools.train_common import all_drafter_taps, feature_store

    return feature_store(args, target, all_drafter_taps(target.config.num_layers))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_trainers(tmp_path, target, data, cache, kind):
    out = tmp_path / kind
    extra = ["--kind", kind, "--num-taps", "3", "--lr", "3e-3", "--batch-size", "4", "--blocks-per-seq", "4"]
    if kind == "dspark":
        extra += ["--block-size", "4", "--markov-rank", "8", "--sts-blocks", "8"]
    else:
        extra += ["--block-size", "5"]
    args = train_dflash.parse_args(common_args(out, data, cache, 40, *extra))
    res = train_dflash.run(args, target)
    first, last = first_last(res["result"].history)
    assert last < 0.8 * first, (first, last)
    val = res["result"].last_eval
    assert len(val["acc"]) == 4 and val["tau_est"] >= 1.0
    drafter = load_drafter(out / "drafter", target.config)
    assert type(drafter) is (DSparkDrafter if kind == "dspark" else DFlashDrafter)
    if kind == "dspark":
        cfg = json.loads((out / "drafter" / "config.json").read_text())
        sts = json.loads((out / "sts.json").read_text())
        assert cfg["sts_temperatures"] == pytest.approx(sts["temperatures"])
        assert torch.allclose(drafter.sts_temperatures, torch.tensor(sts["temperatures"]))
        assert sts["ece_pooled_after"] <= sts["ece_pooled_before"] + 1e-9
        assert (out / "sts_reliability.png").exists()
    drafter.bind_target(target.embed_tokens, target.lm_head)
    assert_lossless(target, BlockProposer(drafter, threshold=0.1 if kind == "dspark" else 0.0))


def test_init_from_starts_a_block_drafter_from_a_trained_one(tmp_path, target, data, cache):
    """--init-from takes the start drafter's weights and shape (no architecture flags needed), resets
    DSpark's STS temperatures, trains on with a fresh optimizer, and refuses a contradicting flag."""
    shape = ["--num-taps", "3", "--block-size", "3", "--markov-rank", "8"]
    common = ["--kind", "dspark", "--blocks-per-seq", "3", "--lr", "3e-3", "--no-sts", "--batch-size", "4"]
    first = train_dflash.run(train_dflash.parse_args(common_args(tmp_path / "a", data, cache, 6, *common, *shape)),
                             target)
    start = tmp_path / "a" / "drafter"
    cfg = json.loads((start / "config.json").read_text())
    cfg["sts_temperatures"] = [2.0, 2.0, 2.0]  # as if calibrated: must not survive into the new run
    (start / "config.json").write_text(json.dumps(cfg))

    copied = train_dflash.run(train_dflash.parse_args(
        common_args(tmp_path / "b", data, cache, 4, *common, "--init-from", str(start), "--stop-at-step", "0")), target)
    assert copied["summary"]["args"]["block_size"] == 3 and copied["summary"]["args"]["markov_rank"] == 8
    a, b = first["drafter"].state_dict(), copied["drafter"].state_dict()
    for name in a:
        if name != "sts_temperatures":
            torch.testing.assert_close(a[name].half().float(), b[name], atol=0, rtol=0)  # the fp16 checkpoint
    assert torch.equal(b["sts_temperatures"], torch.ones(3))

    trained = train_dflash.run(train_dflash.parse_args(
        common_args(tmp_path / "c", data, cache, 3, *common, "--init-from", str(start))), target)
    assert trained["result"].step == 3 and trained["result"].finished
    assert load_drafter(tmp_path / "c" / "drafter", target.config).config.markov_rank == 8

    with pytest.raises(SpecrtError, match="--block-size 4"):
        train_dflash.run(train_dflash.parse_args(
            common_args(tmp_path / "d", data, cache, 2, *common, "--init-from", str(start), "--block-size", "4")), target)
    with pytest.raises(SpecrtError, match="not a dflash drafter"):
        train_dflash.run(train_dflash.parse_args(
            common_args(tmp_path / "e", data, cache, 2, "--kind", "dflash", "--init-from", str(start))), target)


def test_resume_continues_from_the_saved_step(tmp_path, target, data, cache):
    extra = ["--kind", "dspark", "--num-taps", "3", "--block-size", "3", "--markov-rank", "8", "--blocks-per-seq",
             "3", "--lr", "3e-3", "--no-sts", "--batch-size", "4"]
    straight = train_dflash.run(train_dflash.parse_args(common_args(tmp_path / "a", data, cache, 8, *extra)), target)
    stopped = train_dflash.run(
        train_dflash.parse_args(common_args(tmp_path / "b", data, cache, 8, *extra, "--stop-at-step", "5")), target)
    assert stopped["result"].step == 5 and not stopped["result"].finished
    state = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)
    assert state["step"] == 5 and len(state["history"]["train"]) == 5
    resumed = train_dflash.run(
        train_dflash.parse_args(common_args(tmp_path / "b", data, cache, 8, *extra, "--resume")), target)
    assert resumed["result"].step == 8 and resumed["result"].finished
    assert [r["loss"] for r in resumed["result"].history["train"]] == pytest.approx(
        [r["loss"] for r in straight["result"].history["train"]], rel=1e-5)
    a, b = straight["drafter"].state_dict(), resumed["drafter"].state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_time_budget_anneals_and_ends_the_run(tmp_path, target, data, cache):
    from specrt.tools.train_common import warmup_cosine

    assert warmup_cosine(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(20, 100, 10, 0.1, progress=1.0) == pytest.approx(0.1)  # time ran out first
    extra = ["--kind", "dflash", "--num-taps", "3", "--block-size", "3", "--blocks-per-seq", "2", "--max-minutes",
             "0.004"]
    res = train_dflash.run(train_dflash.parse_args(common_args(tmp_path / "t", data, cache, 100000, *extra)), target)
    assert res["result"].finished and 1 <= res["result"].step < 100000
    state = torch.load(tmp_path / "t" / "train_state.pt", weights_only=False)
    assert state["progress"] == 1.0
    lrs = [r["lr"] for r in res["result"].history["train"]]
    if len(lrs) >= 5:  # warmed up on time, then annealed on time
        assert lrs[-1] < 0.7 * max(lrs)
    assert (tmp_path / "t" / "drafter" / "model.safetensors").exists()


def test_cli_mains_train_then_calibrate(tmp_path, target, data, cache, monkeypatch):
    """`main(argv)` wiring of a trainer and of the standalone STS tool (the target loader stubbed)."""
    import specrt.tools.train_common as common

    monkeypatch.setattr(common, "load_target_model", lambda args: target)
    out = tmp_path / "cli"
    argv = common_args(out, data, cache, 6, "--kind", "dspark", "--num-taps", "3", "--block-size", "3",
                       "--markov-rank", "8", "--blocks-per-seq", "2", "--no-sts")
    assert train_dflash.main(argv) == 0
    assert "sts_temperatures" in json.loads((out / "drafter" / "config.json").read_text())  # ones until calibrated
    assert calibrate_sts.main(["--drafter", str(out / "drafter"), "--data", str(data), "--cache-dir", str(cache),
                               "--blocks-per-seq", "4", "--no-progress"]) == 0
    sts = json.loads((out / "sts.json").read_text())
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["sts_temperatures"] == pytest.approx(sts["temperatures"]) and cfg["torch_dtype"] == "float16"
    assert load_drafter(out / "drafter", target.config).sts_temperatures.tolist() == pytest.approx(sts["temperatures"])


def test_compare_runs_tables_and_plots_evaluations_at_equal_steps(tmp_path, capsys):
    from specrt.tools.compare_runs import main as compare_main

    for name, taus in (("a", (1.05, 1.20)), ("b", (1.10, 1.31))):
        (tmp_path / name).mkdir()
        rows = [{"step": 250 * (i + 1), "loss": 6.0 - i, "acc": [0.1 * (i + 1)], "tau_est": t} for i, t in enumerate(taus)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plot.png"
    assert compare_main(["--run", f"one={tmp_path / 'a'}", "--run", f"two={tmp_path / 'b'}", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| two | 500 | 5.000 | 0.200 | 1.310 |" in text and "| one | 250 | 6.000 | 0.100 | 1.050 |" in text
    assert out.stat().st_size > 0
    assert compare_main(["--run", "nofolder", "--out", str(out)]) == 2
    assert compare_main(["--run", f"x={tmp_path / 'missing'}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "NAME=FOLDER" in err and "metrics.jsonl does not exist" in err


# -- precision ------------------------------------------------------------------------------------
def test_resolve_precision():
    from specrt.tools.train_common import resolve_precision

    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    assert resolve_precision("auto", "cuda:0") == "bf16"
    assert resolve_precision("auto") in ("fp32", "bf16")
    with pytest.raises(SpecrtError, match="--precision"):
        resolve_precision("fp8")


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_bf16_forward_is_close_to_fp32_and_labels_stay_fp32(tmp_path, target, data, cache, kind):
    """The same batch under bf16 autocast: the loss moves by bf16 rounding only, the target's label
    distributions are computed in fp32 (bitwise the same as without autocast)."""
    from specrt.tools.train_common import autocast, step_generator

    if kind == "eagle3":
        module, extra = train_eagle3, ["--draft-vocab-size", "40", "--intermediate-size", "48"]
    else:
        module, extra = train_dflash, ["--kind", "dspark", "--num-taps", "3", "--block-size", "4",
                                       "--markov-rank", "8", "--blocks-per-seq", "4"]
    args = module.parse_args(common_args(tmp_path / kind, data, cache, 1, *extra))
    prep = module.prepare(args, target)
    batch = prep.plan(0)
    losses = {}
    for precision in ("fp32", "bf16"):
        with autocast(precision):
            loss, _ = prep.objective.loss(prep.drafter, batch, step_generator(0, 0))
        loss.backward()
        grads = [p.grad.detach().clone() for p in prep.drafter.parameters() if p.grad is not None]
        prep.drafter.zero_grad(set_to_none=True)
        losses[precision] = (float(loss.detach()), grads)
    f32, b16 = losses["fp32"][0], losses["bf16"][0]
    assert f32 != b16, "autocast did not change the forward"
    assert abs(f32 - b16) <= 0.03 * abs(f32), (f32, b16)
    for g32, g16 in zip(losses["fp32"][1], losses["bf16"][1]):
        assert torch.nn.functional.cosine_similarity(g32.flatten(), g16.flatten(), dim=0) > 0.95
    if kind == "eagle3":  # the label path: target logits over the draft vocabulary, fp32 under autocast
        h = torch.randn(3, target.config.hidden_size)
        ref = prep.objective.target_norm(h).float() @ prep.objective.head.T
        from specrt.tools.train_common import full_precision

        with autocast("bf16"), full_precision():
            got = prep.objective.target_norm(h).float() @ prep.objective.head.T
        assert got.dtype == torch.float32 and torch.equal(got, ref)


def test_eagle3_trainer_learns_in_bf16(tmp_path, target, data, cache):
    out = tmp_path / "eagle3_bf16"
    argv = common_args(out, data, cache, 40, "--draft-vocab-size", "40", "--intermediate-size", "48",
                       "--lr", "3e-3", "--batch-size", "4")
    argv[argv.index("fp32")] = "bf16"
    res = train_eagle3.run(train_eagle3.parse_args(argv), target)
    first, last = first_last(res["result"].history)
    assert last < 0.7 * first, (first, last)
    assert res["summary"]["args"]["precision"] == "bf16"
    auto = train_eagle3.parse_args(argv[:argv.index("bf16") - 1] + argv[argv.index("bf16") + 1:])
    assert auto.precision == "auto"
    from specrt.tools.train_common import LoopConfig

    assert LoopConfig.from_args(auto, 1, "x").precision == auto.precision in ("fp32", "bf16")  # resolved in place


# -- wider K/V for block drafters ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_repeat_kv_heads_keeps_the_function_and_drafts_losslessly(target, kind):
    from specrt.export.models.dflash import repeat_kv_heads

    torch.manual_seed(5)
    if kind == "dflash":
        drafter = DFlashDrafter(DFlashConfig.for_target(target.config, num_layers=2, block_size=4, num_taps=3))
    else:
        drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=2, block_size=3, num_taps=3,
                                                        markov_rank=8))
        with torch.no_grad():
            drafter.sts_temperatures.fill_(1.5)
    drafter.bind_target(target.embed_tokens, target.lm_head)
    grown = repeat_kv_heads(drafter.eval(), 4).eval()
    assert grown.config.num_kv_heads == 4 and drafter.config.num_kv_heads == 2
    assert grown.layers[0].self_attn.k_proj.weight.shape[0] == 4 * drafter.config.head_dim
    n = 12
    taps = torch.randn(1, n, 3 * 32)
    tokens = torch.randint(0, VOCAB, (1, n))
    anchors, valid = torch.tensor([[3, 7]]), torch.tensor([[True, True]])
    with torch.no_grad():
        before = dflash_blocks.packed_block_hidden(drafter, taps, tokens, anchors, valid)
        after = dflash_blocks.packed_block_hidden(grown, taps, tokens, anchors, valid)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    if kind == "dspark":
        assert torch.equal(grown.sts_temperatures, drafter.sts_temperatures)
    with pytest.raises(SpecrtError, match="multiple of 2"):
        repeat_kv_heads(drafter, 3)
    assert_lossless(target, BlockProposer(grown, threshold=0.0))


def test_block_trainer_grows_kv_heads_from_the_target_and_from_a_start_drafter(tmp_path, target, data, cache):
    common = ["--kind", "dflash", "--num-taps", "3", "--block-size", "3", "--blocks-per-seq", "3", "--batch-size", "4"]
    fresh = train_dflash.run(train_dflash.parse_args(
        common_args(tmp_path / "a", data, cache, 2, *common, "--num-kv-heads", "4")), target)
    layer = fresh["drafter"].layers[0].self_attn
    assert fresh["drafter"].config.num_kv_heads == 4
    # started from the target's last layer: its 2 K heads repeated in place (before training moved them)
    start = train_dflash.run(train_dflash.parse_args(
        common_args(tmp_path / "s", data, cache, 2, *common, "--num-kv-heads", "4", "--stop-at-step", "0")), target)
    theirs = target.layers[-1].self_attn.k_proj.weight
    d = target.config.head_dim
    torch.testing.assert_close(start["drafter"].layers[0].self_attn.k_proj.weight.view(4, d, -1),
                               theirs.view(2, d, -1).repeat_interleave(2, dim=0))
    assert layer.v_proj.weight.shape[0] == 4 * d
    base = train_dflash.run(train_dflash.parse_args(common_args(tmp_path / "b", data, cache, 2, *common)), target)
    grown = train_dflash.run(train_dflash.parse_args(common_args(
        tmp_path / "c", data, cache, 2, *common, "--init-from", str(tmp_path / "b" / "drafter"), "--num-kv-heads", "4")),
        target)
    assert base["drafter"].config.num_kv_heads == 2 and grown["drafter"].config.num_kv_heads == 4
    assert load_drafter(tmp_path / "c" / "drafter", target.config).config.num_kv_heads == 4
