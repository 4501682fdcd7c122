"""Exported graphs (ONNX Runtime, CPU EP) against the torch models, on tiny random models.

The torch side is the models' own in-place-cache code (`LlamaModel.forward`, `Eagle3Drafter.forward`,
`DFlashDrafter.ingest_context` / `forward`, `DSparkDrafter.draft`); the ONNX side follows the graph
contract: read-only per-layer caches, past_mask + tree_mask, new K/V returned for the runtime to write.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
import pytest
import torch

from _onnx_tiny import TARGET_CFG, make_drafters, make_target
from specrt.export import onnx_export as ox
from specrt.plugins import onnx_ops
from specrt.tools.compare import compare, random_inputs

ort = pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)

ATOL = 1e-4


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every graph, exported once: the target (EAGLE-3 taps) and the three drafters' graphs."""
    torch.manual_seed(0)
    target = make_target()
    drafters = make_drafters(target)
    folder = tmp_path_factory.mktemp("graphs")
    graphs = {}
    for spec in ox.graph_specs(target, drafters["eagle3"]):
        graphs[spec.name] = (spec, ox.export_graph(spec, folder))
    for kind in ("dflash", "dspark"):
        for spec in ox.drafter_specs(drafters[kind], torch.float32):
            graphs[spec.name] = (spec, ox.export_graph(spec, folder))
    return {"target": target, "drafters": drafters, "graphs": graphs, "folder": folder}


def random_tree(g: torch.Generator, batch: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Branching tree per row (node 1 and 2 are both children of 0): (mask [B,T,T], depth [B,T])."""
    mask = torch.zeros(batch, t, t, dtype=torch.bool)
    depth = torch.zeros(batch, t, dtype=torch.long)
    for b in range(batch):
        parents = [-1, 0, 0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(3, t)]
        for i, p in enumerate(parents[:t]):
            mask[b, i, i] = True
            depth[b, i] = 0 if p < 0 else depth[b, p] + 1
            while p >= 0:
                mask[b, i, p] = True
                p = parents[p]
    return mask, depth


def inplace_mask(lengths, tree):
    """The torch models' convention: new token t at slot lengths+t, one mask over [committed | new]."""
    b, t = tree.shape[:2]
    slots = lengths[:, None] + torch.arange(t)[None, :]
    window = int(slots.max()) + 1
    mask = (torch.arange(window)[None, None, :] < lengths[:, None, None]).expand(b, t, window).clone()
    mask.scatter_(2, slots[:, None, :].expand(b, t, t), tree)
    return mask, slots


def cache_feeds(k_cache, v_cache):
    feeds = {}
    for i in range(k_cache.shape[0]):
        feeds[f"past_key_{i}"] = k_cache[i].numpy().copy()
        feeds[f"past_value_{i}"] = v_cache[i].numpy().copy()
    return feeds


def past_mask_for(lengths, t):
    window = int(lengths.max())
    return (torch.arange(window)[None, None, :] < lengths[:, None, None]).expand(len(lengths), t, window).clone()


def written_rows(cache, slots):
    """cache [L, B, H, C, D] at slots [B, T] -> [L, B, H, T, D]."""
    return torch.stack([cache[:, i].index_select(2, slots[i]) for i in range(cache.shape[1])], dim=1)


# -- validity -------------------------------------------------------------------------------------------
def test_every_graph_is_valid_plain_onnx_with_specrt_functions(exported):
    expected_ops = {
        "target": ["TreeAttention"], "eagle3_fc": [], "eagle3_step": ["TreeAttention"], "dflash_ingest": [],
        "dflash_block": ["TreeAttention"], "dspark_ingest": [], "dspark_block": ["ConfidenceTruncate", "TreeAttention"],
    }
    assert set(exported["graphs"]) == set(expected_ops)
    for name, (_, graph) in exported["graphs"].items():
        onnx.checker.check_model(str(graph.path), full_check=True)
        model = onnx.load(str(graph.path))
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
        assert onnx_ops.audit_domains(model) == [], name
        assert sorted(f.name for f in model.functions) == expected_ops[name]
        assert {o.domain for o in model.opset_import} <= {"", "specrt"}
        domains = {n.domain for n in model.graph.node}
        assert domains <= {"", "specrt"}, (name, domains)
        assert graph.custom_ops == [f"specrt::{op}" for op in expected_ops[name]]


def test_dynamic_dims_are_named(exported):
    spec, graph = exported["graphs"]["target"]
    shapes = {i["name"]: i["shape"] for i in graph.inputs + graph.outputs}
    assert shapes["input_ids"] == ["batch", "seq"] and shapes["tree_mask"] == ["batch", "seq", "seq"]
    assert shapes["past_mask"] == ["batch", "seq", "past"] and shapes["past_key_0"] == ["batch", 2, "capacity", 8]
    assert shapes["logits"] == ["batch", "rows", 64] and shapes["new_keys"] == [6, "batch", 2, "seq", 8]
    assert shapes["taps"] == ["batch", "seq", 3 * 32]
    _, block = exported["graphs"]["dspark_block"]
    assert {i["name"]: i["shape"] for i in block.inputs}["block_ids"] == ["batch", 4]


# -- target ---------------------------------------------------------------------------------------------
def test_target_tree_verify_with_partly_filled_cache(exported):
    target = exported["target"]
    _, graph = exported["graphs"]["target"]
    g = torch.Generator().manual_seed(1)
    b, capacity, t = 3, 24, 6
    k_cache, v_cache = target.new_cache(b, capacity)
    k_cache.normal_(generator=g)
    v_cache.normal_(generator=g)
    lengths = torch.tensor([9, 4, 0])  # a long row, a short row, an empty row: partly filled cache
    tree, depth = random_tree(g, b, t)
    ids = torch.randint(0, 64, (b, t), generator=g)
    positions = lengths[:, None] + depth
    rows = torch.tensor([[0, 2, 5], [1, 3, 4], [0, 1, 2]])
    feeds = {"input_ids": ids.numpy(), "position_ids": positions.numpy(),
             "past_mask": past_mask_for(lengths, t).numpy(), "tree_mask": tree.numpy(), "logit_rows": rows.numpy(),
             **cache_feeds(k_cache, v_cache)}
    logits, taps, new_k, new_v = session(graph.path).run(None, feeds)
    mask, slots = inplace_mask(lengths, tree)
    with torch.no_grad():
        ref_logits, ref_taps = target(ids, positions, mask, k_cache, v_cache, slots, rows)
    assert np.abs(logits - ref_logits.numpy()).max() <= ATOL
    assert np.abs(taps - ref_taps.numpy()).max() <= ATOL
    assert np.abs(new_k - written_rows(k_cache, slots).numpy()).max() <= ATOL
    assert np.abs(new_v - written_rows(v_cache, slots).numpy()).max() <= ATOL


def test_target_prefill_then_decode_with_the_runtime_writing_the_cache(exported):
    """The cache contract end to end: ORT prefill (empty past), host writes new K/V, ORT decode."""
    target = exported["target"]
    _, graph = exported["graphs"]["target"]
    sess = session(graph.path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (1, 9), generator=g)
    layers, capacity = target.config.num_layers, 16
    k_buf = np.zeros((layers, 1, 2, capacity, 8), np.float32)
    v_buf = np.zeros_like(k_buf)
    prompt = ids[:, :7]
    feeds = {"input_ids": prompt.numpy(), "position_ids": torch.arange(7)[None].numpy(),
             "past_mask": np.zeros((1, 7, 0), np.bool_), "tree_mask": np.tril(np.ones((1, 7, 7), np.bool_)),
             "logit_rows": np.array([[6]]), **{f"past_{kv}_{i}": buf[i] for i in range(layers)
                                              for kv, buf in (("key", k_buf), ("value", v_buf))}}
    logits_prefill, _, new_k, new_v = sess.run(None, feeds)
    k_buf[:, :, :, :7], v_buf[:, :, :, :7] = new_k, new_v  # the runtime's write: T rows, no cache copy
    step = {"input_ids": ids[:, 7:9].numpy(), "position_ids": np.array([[7, 8]]),
            "past_mask": np.ones((1, 2, 7), np.bool_), "tree_mask": np.tril(np.ones((1, 2, 2), np.bool_)),
            "logit_rows": np.array([[0, 1]]), **{f"past_{kv}_{i}": buf[i] for i in range(layers)
                                                for kv, buf in (("key", k_buf), ("value", v_buf))}}
    logits_step = sess.run(None, step)[0]
    k, v = target.new_cache(1, 9)
    mask = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None]
    with torch.no_grad():
        full, _ = target(ids, torch.arange(9)[None], mask, k, v, torch.arange(9)[None])
    assert np.abs(logits_prefill[0, 0] - full[0, 6].numpy()).max() <= ATOL
    assert np.abs(logits_step[0] - full[0, 7:9].numpy()).max() <= ATOL


# -- EAGLE-3 ---------------------------------------------------------------------------------------------
def test_eagle3_fc_and_step_for_tree_expansion(exported):
    drafter = exported["drafters"]["eagle3"]
    _, fc_graph = exported["graphs"]["eagle3_fc"]
    _, step_graph = exported["graphs"]["eagle3_step"]
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(2, 5, 96, generator=g)
    (hidden,) = session(fc_graph.path).run(None, {"taps": taps.numpy()})
    assert np.abs(hidden - drafter.fuse(taps).detach().numpy()).max() <= ATOL

    # a frontier of tree nodes in scratch slots past a partly filled context
    b, t, capacity = 2, 5, 20
    k_cache, v_cache = drafter.new_cache(b, capacity)
    k_cache.normal_(generator=g)
    v_cache.normal_(generator=g)
    lengths = torch.tensor([8, 3])
    tree, depth = random_tree(g, b, t)
    ids = torch.randint(0, 64, (b, t), generator=g)
    feat = torch.randn(b, t, 32, generator=g)
    positions = lengths[:, None] - 1 + depth
    every_row = np.broadcast_to(np.arange(t), (b, t)).copy()
    feeds = {"input_ids": ids.numpy(), "hidden": feat.numpy(), "position_ids": positions.numpy(),
             "past_mask": past_mask_for(lengths, t).numpy(), "tree_mask": tree.numpy(), "logit_rows": every_row,
             **cache_feeds(k_cache, v_cache)}
    logits, out, new_k, new_v = session(step_graph.path).run(None, feeds)
    mask, slots = inplace_mask(lengths, tree)
    with torch.no_grad():
        ref_logits, ref_out = drafter(ids, feat, positions, mask, k_cache, v_cache, slots)
    assert logits.shape == (b, t, 40)
    assert np.abs(logits - ref_logits.numpy()).max() <= ATOL
    # a context ingest asks for one row per batch row: those rows' logits, the same hidden and K/V
    last = np.array([[t - 1], [2]])
    few_logits, few_out, _, _ = session(step_graph.path).run(None, {**feeds, "logit_rows": last})
    assert few_logits.shape == (b, 1, 40)
    assert np.abs(few_logits[:, 0] - ref_logits.numpy()[[0, 1], [t - 1, 2]]).max() <= ATOL
    assert np.abs(few_out - ref_out.numpy()).max() <= ATOL
    assert np.abs(out - ref_out.numpy()).max() <= ATOL
    assert np.abs(new_k - written_rows(k_cache, slots).numpy()).max() <= ATOL
    assert np.abs(new_v - written_rows(v_cache, slots).numpy()).max() <= ATOL


# -- DFlash / DSpark --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_ingest_matches_the_context_cache(exported, kind):
    drafter = exported["drafters"][kind]
    _, graph = exported["graphs"][f"{kind}_ingest"]
    g = torch.Generator().manual_seed(4)
    taps = torch.randn(2, 6, 96, generator=g)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    new_k, new_v = session(graph.path).run(None, {"taps": taps.numpy(), "position_ids": positions.numpy()})
    k_cache, v_cache = drafter.new_cache(2, 12)
    with torch.no_grad():
        drafter.ingest_context(taps, positions, k_cache, v_cache, positions)
    assert np.abs(new_k - written_rows(k_cache, positions).numpy()).max() <= ATOL
    assert np.abs(new_v - written_rows(v_cache, positions).numpy()).max() <= ATOL


def block_inputs(drafter, g, lengths, capacity=16):
    b, bk = len(lengths), drafter.config.block_size
    k_cache, v_cache = drafter.new_cache(b, capacity)
    k_cache.normal_(generator=g)
    v_cache.normal_(generator=g)
    block = drafter.block_ids(torch.randint(0, 64, (b,), generator=g))
    positions = lengths[:, None] + torch.arange(bk)[None, :]
    window = int(lengths.max()) + bk
    slots = torch.arange(window)[None, None, :]
    start = lengths[:, None, None]
    mask = ((slots < start) | ((slots >= start) & (slots < start + bk))).expand(b, bk, window)
    feeds = {"block_ids": block.numpy(), "position_ids": positions.numpy(),
             "past_mask": past_mask_for(lengths, bk).numpy(), **cache_feeds(k_cache, v_cache)}
    return feeds, (block, positions, mask, k_cache, v_cache, positions)


def test_dflash_block_matches_forward(exported):
    drafter = exported["drafters"]["dflash"]
    _, graph = exported["graphs"]["dflash_block"]
    feeds, args = block_inputs(drafter, torch.Generator().manual_seed(5), torch.tensor([7, 2]))
    logits, hidden = session(graph.path).run(None, feeds)
    with torch.no_grad():
        ref_logits, ref_hidden = drafter(*args)
    assert np.abs(logits - ref_logits.numpy()).max() <= ATOL
    assert np.abs(hidden - ref_hidden.numpy()).max() <= ATOL


def test_dspark_block_greedy_chain_confidence_and_truncation(exported):
    drafter = exported["drafters"]["dspark"]
    _, graph = exported["graphs"]["dspark_block"]
    feeds, args = block_inputs(drafter, torch.Generator().manual_seed(6), torch.tensor([6, 3, 0]))
    b, gamma = 3, drafter.config.block_size
    threshold = 0.3
    feeds.update(temperature=np.zeros(b, np.float32), gumbel=np.random.default_rng(0).gumbel(size=(b, gamma, 64))
                 .astype(np.float32), threshold=np.array(threshold, np.float32), sps=np.zeros(1, np.float32))
    tokens, markov_logits, conf, survival, length = session(graph.path).run(None, feeds)
    ref_tokens, _, ref_conf = drafter.draft(*args, temperature=0.0)
    assert tokens.tolist() == ref_tokens.tolist()
    assert np.abs(conf - ref_conf.numpy()).max() <= ATOL
    ref_survival = drafter.survival(ref_conf)
    assert np.abs(survival - ref_survival.numpy()).max() <= 1e-5
    assert length.tolist() == (ref_survival >= threshold).long().cumprod(-1).sum(-1).tolist()
    # markov_logits are l_k = U_k + W2 W1[prev] along the chain
    with torch.no_grad():
        base, hidden = drafter(*args)
        prev = torch.cat([args[0][:, :1], ref_tokens[:, :-1]], dim=1)
        ref_l = drafter.markov_block_logits(base, prev, hidden)
    assert np.abs(markov_logits - ref_l.numpy()).max() <= ATOL


def test_dspark_block_sampling_is_gumbel_max_of_the_markov_logits(exported):
    drafter = exported["drafters"]["dspark"]
    spec, graph = exported["graphs"]["dspark_block"]
    feeds, _ = block_inputs(drafter, torch.Generator().manual_seed(7), torch.tensor([5, 5]))
    gumbel = np.random.default_rng(1).gumbel(size=(2, 4, 64)).astype(np.float32)
    feeds.update(temperature=np.array([0.7, 1.5], np.float32), gumbel=gumbel, threshold=np.array(0.0, np.float32),
                 sps=np.array([0, 40, 70, 90, 100, 105, 107, 108, 108, 108, 108], np.float32))
    tokens, markov_logits, _, survival, length = session(graph.path).run(None, feeds)
    scores = markov_logits + feeds["temperature"][:, None, None] * gumbel
    assert tokens.tolist() == scores.argmax(-1).tolist()
    # the SPS policy inside the graph equals the runtime's scheduler
    from specrt.runtime.scheduler import schedule

    table = feeds["sps"]
    expected = schedule(survival.astype(np.float64).tolist(), lambda n: float(table[n]), max_tokens=len(table) - 1)
    assert length.tolist() == expected.lengths
    # and the torch export wrapper (eager custom ops) agrees with the graph
    ref = spec.module(*[torch.from_numpy(feeds[name]) for name, _, _ in spec.inputs])
    assert ref[0].tolist() == tokens.tolist() and ref[4].tolist() == length.tolist()


# -- the compare tool, external data, dtype and opset variants --------------------------------------------
def test_compare_tool_on_every_graph(exported):
    for name, (spec, graph) in exported["graphs"].items():
        sizes = {"block": exported["drafters"]["dflash"].config.block_size}
        feeds = random_inputs(graph.inputs, sizes, vocab_size=64, seed=3)
        diffs, verdict = compare(graph.path, spec.module, feeds, [i["name"] for i in graph.inputs],
                                 [o["name"] for o in graph.outputs], atol=ATOL, rtol=1e-3)
        assert all(d.ok for d in diffs), (name, [d.line() for d in diffs])
        assert verdict in (None, True)


def test_external_data_and_opset_18(exported, tmp_path):
    drafter = exported["drafters"]["eagle3"]
    fc, step = ox.drafter_specs(drafter, torch.float32)
    graph = ox.export_graph(fc, tmp_path, external_data="always")
    assert graph.data_path is not None and graph.data_path.is_file()
    assert graph.path.stat().st_size < graph.data_path.stat().st_size
    taps = np.random.default_rng(0).standard_normal((1, 3, 96)).astype(np.float32)
    (hidden,) = session(graph.path).run(None, {"taps": taps})
    assert np.abs(hidden - drafter.fuse(torch.from_numpy(taps)).detach().numpy()).max() <= ATOL
    old = ox.export_graph(step, tmp_path, opset=18)
    model = onnx.load(str(old.path))
    assert [(o.domain, o.version) for o in model.opset_import if o.domain == ""] == [("", 18)]
    assert [o.version for f in model.functions for o in f.opset_import] == [18]
    feeds = random_inputs(old.inputs, {}, vocab_size=64, seed=1)
    diffs, _ = compare(old.path, step.module, feeds, [i["name"] for i in old.inputs],
                       [o["name"] for o in old.outputs], use_polygraphy=False)
    assert all(d.ok for d in diffs), [d.line() for d in diffs]


def test_float16_target_graph(tmp_path):
    cfg = dataclasses.replace(TARGET_CFG, num_layers=2)
    target = make_target(cfg, seed=5).to(torch.float16)
    target.set_taps([2])
    graph = ox.export_graph(ox.target_spec(target, torch.float16), tmp_path)
    dtypes = {i["name"]: i["dtype"] for i in graph.inputs + graph.outputs}
    assert dtypes["past_key_0"] == "float16" and dtypes["taps"] == "float16" and dtypes["logits"] == "float32"
    ref = make_target(cfg, seed=5)
    ref.set_taps([2])
    feeds = random_inputs(graph.inputs, {}, vocab_size=64, seed=2)
    got = session(graph.path).run(["logits"], feeds)[0]
    want = ox.TargetGraph(ref)(*[torch.from_numpy(feeds[i["name"]]).float() if feeds[i["name"]].dtype == np.float16
                                 else torch.from_numpy(feeds[i["name"]]) for i in graph.inputs])[0]
    assert np.abs(got - want.detach().numpy()).max() < 0.05
