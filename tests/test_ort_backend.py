"""The ONNX Runtime backend on tiny exported engines: same tokens as the torch backend, same drafts,
no cache copies, clear errors. (The real SmolLM2 engines: test_ort_smollm2.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from _onnx_tiny import make_drafters, make_sharp_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.plugins.errors import SpecrtError
from specrt.tools.cli_export import main as export_main
from specrt.runtime.backends.ort_models import split_window_mask
from specrt.runtime.pipeline import Pipeline
from specrt.runtime.sampling import SamplingParams

pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)

KINDS = ("eagle3", "dflash", "dspark")
PROMPTS = [[5, 9, 23, 7], [3, 44, 12, 60, 8, 31, 2], [17]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort")
    target = make_sharp_target()
    drafters = make_drafters(target)
    write_hf_target(root / "tiny", target)
    engines = {}
    for kind in KINDS:
        save_drafter(drafters[kind], root / f"ckpt-{kind}", dtype=torch.float32)
        out = root / f"engine-{kind}"
        assert export_main(["--drafter", kind, "--target", str(root / "tiny"), "--drafter-ckpt",
                            str(root / f"ckpt-{kind}"), "--out", str(out), "--quiet"]) == 0
        engines[kind] = out
    out = root / "engine-none"
    assert export_main(["--drafter", "none", "--target", str(root / "tiny"), "--out", str(out), "--quiet"]) == 0
    engines["none"] = out
    out = root / "engine-dspark-int8"
    assert export_main(["--drafter", "dspark", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt-dspark"),
                        "--out", str(out), "--weights", "int8", "--quant-block", "16", "--quiet"]) == 0
    engines["dspark-int8"] = out
    return {"root": root, "engines": engines}


def torch_pipeline(folders, kind: str = "none") -> Pipeline:
    from specrt.export.draft_options import DraftOptions

    ckpt = None if kind == "none" else folders["root"] / f"ckpt-{kind}"
    # the drafter alone (no copies grafted on), so its drafts can be compared with the ORT twin's
    return Pipeline.from_checkpoint(folders["root"] / "tiny", drafter=kind, drafter_ckpt=ckpt,
                                    draft_options=DraftOptions(lookup=0))


def test_split_window_mask_matches_the_slot_view():
    g = torch.Generator().manual_seed(0)
    b, t, w = 2, 4, 9
    mask = torch.rand(b, t, w, generator=g) > 0.4
    slots = torch.tensor([[3, 4, 5, 6], [5, 7, 7, 8]])  # row 1 repeats slot 7 (padding)
    past, tree = split_window_mask(mask, slots)
    for bi in range(b):
        own = set(slots[bi].tolist())
        for ti in range(t):
            for s in range(w):
                assert past[bi, ti, s] == (mask[bi, ti, s] and s not in own)
            for u in range(t):
                first = slots[bi].tolist().index(int(slots[bi, u])) == u
                assert tree[bi, ti, u] == (bool(mask[bi, ti, slots[bi, u]]) and first)


def test_plain_decoding_equals_torch(folders):
    ort_pipe = Pipeline.from_engines(folders["engines"]["none"], drafter="none")
    ref = torch_pipeline(folders).generate_ids(PROMPTS, 24)
    got = ort_pipe.generate_ids(PROMPTS, 24)
    assert got.tokens == ref.tokens
    assert ort_pipe.proposer is None and ort_pipe.backend == "ort"


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_greedy_equals_torch_plain_and_drafts_like_torch(folders, kind):
    plain = torch_pipeline(folders).generate_ids(PROMPTS, 24)
    torch_spec = torch_pipeline(folders, kind)
    ort_pipe = Pipeline.from_engines(folders["engines"][kind], drafter=kind, draft_options=torch_spec_options(torch_spec),
                                     measured=False)
    assert ort_pipe.proposer.name == kind
    for i, prompt in enumerate(PROMPTS):  # batch 1
        got = ort_pipe.generate_ids([prompt], 24)
        ref = torch_spec.generate_ids([prompt], 24)
        assert got.tokens[0] == plain.tokens[i]
        assert got.tokens == ref.tokens
        # the same drafts were proposed and accepted, round by round: the drafter graphs behave as torch
        assert got.stats[0].accepted_per_position == ref.stats[0].accepted_per_position
        assert got.stats[0].rounds == ref.stats[0].rounds
    batched = ort_pipe.generate_ids(PROMPTS, 24)  # batch 3, different prompt lengths
    assert batched.tokens == plain.tokens


def test_eagle3_step_graphs_without_logit_rows_give_the_rows_asked_for(folders):
    """An ingest asks the EAGLE-3 step for its last row's logits; a folder whose eagle3_step computes
    every row's (exported before it took logit_rows) gives the same rows, picked by the runtime."""
    pipe = Pipeline.from_engines(folders["engines"]["eagle3"], drafter="eagle3")
    drafter = pipe.proposer.inner.drafter if hasattr(pipe.proposer, "inner") else pipe.proposer.drafter
    assert drafter.takes_logit_rows
    g = torch.Generator().manual_seed(5)
    t = 5
    ids = torch.randint(0, 64, (1, t), generator=g)
    hidden = torch.randn(1, t, drafter.config.hidden_size, generator=g)
    positions = torch.arange(t)[None]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))[None]

    def call(logit_rows=None):
        k, v = drafter.new_cache(1, 8)
        return drafter(ids, hidden, positions, mask, k, v, positions, logit_rows)

    every, out = call()
    last = torch.tensor([[t - 1]])
    asked, _ = call(last)
    assert asked.shape == (1, 1, every.shape[-1])
    assert torch.allclose(asked[0, 0], every[0, t - 1], atol=1e-5)

    drafter.takes_logit_rows = False  # now as an older folder: its graph computes every row
    run = drafter.step_graph.run
    drafter.step_graph.run = lambda feeds, *a, **kw: run({**feeds, "logit_rows": torch.arange(t)[None]}, *a, **kw)
    old, old_out = call(last)
    assert old.shape == asked.shape and torch.allclose(old, asked) and torch.allclose(old_out, out)


def test_dflash_trees_on_engines_equal_plain_and_dspark_trees_ask_for_torch(folders):
    from specrt.export.draft_options import DraftOptions

    plain = torch_pipeline(folders).generate_ids(PROMPTS, 24)
    tree = DraftOptions(tree_tokens=8, block_tree_top_k=3)
    ort_pipe = Pipeline.from_engines(folders["engines"]["dflash"], draft_options=tree)
    got = ort_pipe.generate_ids(PROMPTS, 24)
    assert got.tokens == plain.tokens
    with pytest.raises(SpecrtError, match="--backend torch"):
        Pipeline.from_engines(folders["engines"]["dspark"], draft_options=tree)


def test_int8_activation_engines_turn_every_tree_into_a_chain(monkeypatch):
    """Engines that decode with two rows for exactness (int4/int8 activations) draft chains, for
    block drafters as for EAGLE-3 (the reason is in `exact_chain_options`)."""
    import types
    from pathlib import Path

    from specrt.runtime.backends.ort_backend import OrtEngines
    from specrt.runtime.proposers import factory
    from specrt.export.draft_options import DraftOptions

    seen = []
    monkeypatch.setattr(factory, "proposer_for", lambda kind, drafter, options, **kw: seen.append(options))
    target = types.SimpleNamespace(two_row_decode=True, config=types.SimpleNamespace(vocab_size=64))
    for kind in ("dflash", "eagle3"):
        engines = OrtEngines(Path("x"), None, target, object(), kind, None, None)
        engines.proposer(DraftOptions(tree_top_k=4, block_tree_top_k=3))
        assert (seen[-1].tree_top_k, seen[-1].block_tree_top_k) == ((4, 1) if kind == "dflash" else (1, 3))
    target.two_row_decode = False
    engines.proposer(DraftOptions(tree_top_k=4, block_tree_top_k=3))
    assert (seen[-1].tree_top_k, seen[-1].block_tree_top_k) == (4, 3)


def torch_spec_options(pipe: Pipeline):
    from specrt.export.draft_options import DraftOptions

    p = pipe.proposer
    if p.name == "eagle3":
        return DraftOptions(p.top_k, p.depth, p.total_tokens, lookup=0)
    return DraftOptions(confidence_threshold=p.threshold, lookup=0)


def test_copies_take_the_shape_the_engine_verifies_exactly(tmp_path):
    """Copies on int8-activation engines with a proposer are one chain (two disagreeing copies as two
    branches would be a tree); a one-token copy is taken whatever its odds only where a one-token call
    runs a whole second row anyway; engines exact on trees may verify both copies."""
    import types

    from specrt.runtime.backends.ort_backend import with_folder_lookup
    from specrt.export.draft_options import DraftOptions

    def shape(**target):
        o = with_folder_lookup(DraftOptions(), tmp_path, types.SimpleNamespace(**target) if target else None)
        return o.lookup_tree, o.lookup_free_first

    assert shape(two_row_decode=True, full_copy_row=False) == (False, False)  # attention rows
    assert shape(two_row_decode=True, full_copy_row=True) == (False, True)  # a full copy row
    assert shape(two_row_decode=False, full_copy_row=False) == (True, False)  # fp32
    assert shape() == (True, False)


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_runs_and_is_reproducible(folders, kind):
    pipe = Pipeline.from_engines(folders["engines"][kind])
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    a = pipe.generate_ids(PROMPTS[:2], 16, sampling)
    b = pipe.generate_ids(PROMPTS[:2], 16, sampling)
    assert a.tokens == b.tokens
    assert all(0 <= t < 64 for row in a.tokens for t in row)


def test_the_cache_is_bound_in_place(folders, monkeypatch):
    """Every step hands ORT the engine's own cache buffers: nothing copies the K/V cache."""
    from specrt.runtime.backends.ort_session import OrtGraph

    pipe = Pipeline.from_engines(folders["engines"]["dspark"], drafter="dspark")
    seen = []
    original = OrtGraph.run

    def spy(self, feeds, outputs=None):
        if "past_key_0" in feeds:
            seen.append((self.path.name, feeds["past_key_0"].data_ptr(), feeds["past_key_0"].is_contiguous()))
        return original(self, feeds, outputs)

    monkeypatch.setattr(OrtGraph, "run", spy)
    pipe.generate_ids([PROMPTS[0]], 12)
    engine = pipe._engine
    target_ptrs = {ptr for name, ptr, contiguous in seen if name == "target.onnx" and contiguous}
    assert target_ptrs == {engine.k_cache[0].data_ptr()}
    drafter_ptrs = {ptr for name, ptr, _ in seen if name == "dspark_block.onnx"}
    assert drafter_ptrs == {pipe.proposer.k_cache[0].data_ptr()}


def test_pipeline_reuses_its_cache_and_grows_it(folders):
    pipe = Pipeline.from_engines(folders["engines"]["none"])
    pipe.generate_ids([PROMPTS[0]], 8)
    first = pipe._engine
    pipe.generate_ids([PROMPTS[1]], 8)
    assert pipe._engine is first
    pipe.generate_ids([PROMPTS[1]], 100)
    assert pipe._engine.capacity >= 107 and pipe._engine is not first


def test_bad_input_is_refused_clearly(folders, tmp_path):
    with pytest.raises(SpecrtError, match="onnxruntime-gpu"):
        Pipeline.from_engines(folders["engines"]["none"], device="cuda")
    with pytest.raises(SpecrtError, match="not dflash"):
        Pipeline.from_engines(folders["engines"]["eagle3"], drafter="dflash")
    with pytest.raises(SpecrtError, match="manifest"):
        Pipeline.from_engines(tmp_path)
    pipe = Pipeline.from_engines(folders["engines"]["none"])
    with pytest.raises(SpecrtError, match="supports 128"):
        pipe.generate_ids([[5] * 100], 64)
    with pytest.raises(SpecrtError, match="threads"):
        Pipeline.from_engines(folders["engines"]["none"], threads=0)


def test_cli_generate_on_engines_prints_stats_and_speedup(folders):
    out = subprocess.run(
        [sys.executable, "-m", "specrt.tools", "generate", "--engines", str(folders["engines"]["dspark"]),
         "--drafter", "dspark", "--prompt", "w5 w9 w23", "--no-chat-template", "--max-new-tokens", "12", "--speedup",
         "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "(ort)" in out.stderr and "drafter: dspark" in out.stderr
    assert "tau " in out.stderr and "identical output" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "specrt.tools", "generate", "--backend", "ort", "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--engines" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("kind", ["dspark", "lookup"])
def test_a_named_proposer_is_measured_against_plain_rounds_unless_asked_not_to(folders, kind):
    """The Python API names a drafter as the CLI does: measured against plain steps and the copies, so
    it runs plain rounds where it measures slower (`AutoProposer.dormant`); measured=False drafts
    every round. Either way the text is plain decoding's."""
    from specrt.runtime.proposers.auto import AutoProposer

    folder = folders["engines"]["dspark"]
    guarded = Pipeline.from_engines(folder, drafter=kind)
    alone = Pipeline.from_engines(folder, drafter=kind, measured=False)
    pinned = "drafter" if kind == "dspark" else "copies"
    assert isinstance(guarded.proposer, AutoProposer) and guarded.proposer.pinned == pinned
    assert not isinstance(alone.proposer, AutoProposer)
    assert guarded.proposer.name == alone.proposer.name  # the user's choice, by its own name
    plain = guarded.generate_ids(PROMPTS, 16, speculative=False).tokens
    for pipe in (guarded, alone):
        assert [pipe.generate_ids([p], 16).tokens[0] for p in PROMPTS] == plain


def test_copies_alone_run_on_a_target_only_folder(folders):
    """`--drafter lookup` needs no drafter graph: the folder exported with --drafter none speculates."""
    out = subprocess.run(
        [sys.executable, "-m", "specrt.tools", "generate", "--engines", str(folders["engines"]["none"]),
         "--drafter", "lookup", "--prompt", "w5 w9 w5 w9 w5", "--no-chat-template", "--max-new-tokens", "24",
         "--speedup", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "drafter: lookup" in out.stderr and "identical output" in out.stderr
    pipe = Pipeline.from_engines(folders["engines"]["dspark"], drafter="lookup")
    assert pipe.proposer.name == "lookup" and pipe.proposer.tap_layers == ()
    plain = torch_pipeline(folders).generate_ids(PROMPTS, 24)
    assert pipe.generate_ids(PROMPTS, 24).tokens == plain.tokens


def test_ort_pipelines_run_torch_at_one_thread_and_restore_it(folders, monkeypatch):
    """Between ORT calls torch only does host work; its extra threads would spin on ORT's cores
    (runtime/host_threads.py). The torch backend keeps the caller's threads."""
    from specrt.runtime.step import TokenRule

    seen = []
    real = TokenRule.accept

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(TokenRule, "accept", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Pipeline.from_engines(folders["engines"]["eagle3"]).generate_ids(PROMPTS[:1], 8)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2  # restored for the caller
        seen.clear()
        torch_pipeline(folders, "eagle3").generate_ids(PROMPTS[:1], 8)
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(before)


def test_bench_on_engines_reports_every_drafter_and_the_peers(folders, tmp_path, monkeypatch, capsys):
    """`specrt bench --engines a,b,c` on the tiny engines: tables, plots, lossless counts, peer notes."""
    import json

    import specrt.tools.datasets as datasets
    from specrt.tools.cli import main

    # the tiny vocabulary has no chat text: feed MT-bench-shaped questions made of its own words
    monkeypatch.setattr(datasets, "mtbench_questions", lambda: [{"turns": ["w5 w9 w23"]}, {"turns": ["w40 w2"]}])
    out = tmp_path / "report"
    engines = ",".join(str(folders["engines"][k]) for k in (*KINDS, "dspark-int8"))
    code = main(["bench", "--engines", engines, "--prompts", "2", "--max-new-tokens", "10", "--check-tokens", "10",
                 "--speed-prompts", "2", "--speed-tokens", "6", "--kv-contexts", "8,40", "--threads", "1",
                 "--lookup-variants", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["backend"] == "ort"
    # every drafter with and without copies from the text, and copies alone on each weight format
    configs = [*KINDS, "dspark@int8", *(k + "+lookup" for k in KINDS), "dspark+lookup@int8", "lookup", "lookup@int8"]
    for kind in configs:
        assert report["lossless"][kind] == {"identical": 2, "of": 2, "tokens_compared": 10,
                                            "against": "plain@int8" if "@" in kind else "plain"}
        assert report["acceptance"]["greedy"][kind]["tau"] >= 1.0
    # plain decoding also on sessions of its own (no drafter graph: spinning pool threads, as --drafter none)
    assert set(report["speed"]) == {"plain", "plain@int8", "plain (target only)", "plain@int8 (target only)", *configs}
    assert report["speed"]["dspark@int8"]["vs_own_plain"] > 0
    assert (out / "speed.png").stat().st_size > 0
    assert "plain (target only)" in capsys.readouterr().out
    # a peer that cannot run this target says why (the tiny target is an HF folder, llama.cpp runs GGUF)
    from specrt.tools.peers import llamacpp_peer

    peer = llamacpp_peer(None, 1, 64)
    assert peer.generate is None and ("GGUF" in peer.note or "not installed" in peer.note)
    from specrt.tools.peers import make_peers

    with pytest.raises(SpecrtError, match="unknown peer"):
        make_peers(["vllm"], None, 1, 64)


def test_bench_trees_times_shapes_and_checks_they_equal_plain(folders, monkeypatch, capsys):
    """`tools/bench_trees.py` on the tiny EAGLE-3 engine: every shape (a thresholded chain included)
    is reported, and every output equals plain decoding's."""
    import specrt.tools.datasets as datasets
    from specrt.tools.bench_trees import main as bench_trees, parse_shapes

    assert parse_shapes("4/4/16,1/4/5@0.2") == [(4, 4, 16, 0.0), (1, 4, 5, 0.2)]
    monkeypatch.setattr(datasets, "mtbench_questions", lambda: [{"turns": ["w5 w9 w23"]}, {"turns": ["w40 w2"]}])
    assert bench_trees(["--engines", str(folders["engines"]["eagle3"]), "--shapes", "2/3/5,1/3/4@0.3",
                        "--prompts", "2", "--max-new-tokens", "12", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| plain", "| 2/3/5", "| 1/3/4@0.3"]
    assert all(r.rstrip(" |").endswith("2/2") for r in rows)


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_rows_draft_on_their_noise_in_the_graphs(folders, kind, monkeypatch):
    """The engines' drafters couple seeded drafts to the verification's noise (the DSpark graph
    through its gumbel input): where the noise decides every token, every draft is accepted."""
    import specrt.runtime.seeded as seeded
    from specrt.export.draft_options import DraftOptions

    folder = folders["engines"][kind]
    # tokens the drafter can draft: EAGLE-3's reduced vocabulary (its target ids), else all 64
    allowed = (np.load(folder / "draft_to_target.npy").tolist() if kind == "eagle3" else list(range(64)))

    def token(index: int) -> int:
        return allowed[(7 * index + 3) % len(allowed)]

    def deciding(seed: int, index: int, vocab_size: int) -> torch.Tensor:
        g = torch.zeros(vocab_size)
        g[token(index)] = 1e4
        return g

    monkeypatch.setattr(seeded, "gumbel_noise", deciding)
    sampling = SamplingParams(temperature=1.0, seed=5)
    options = DraftOptions(lookup=0, tree_top_k=1, confidence_threshold=0.0)
    pipe = Pipeline.from_engines(folder, drafter=kind, draft_options=options, measured=False)
    out = pipe.generate_ids([PROMPTS[0]], 20, sampling)
    plain = Pipeline.from_engines(folders["engines"]["none"]).generate_ids([PROMPTS[0]], 20, sampling)
    assert out.tokens[0] == plain.tokens[0] == [token(i) for i in range(len(plain.tokens[0]))]
    assert len(out.tokens[0]) >= 12  # the noise's text runs until it picks an end-of-sequence token
    stats = out.stats[0]
    assert sum(stats.proposed_per_position) >= len(out.tokens[0]) // 2
    assert stats.accepted_per_position == stats.proposed_per_position  # every verified draft kept


def test_bench_coupled_compares_both_ways_of_drafting_and_writes_its_report(folders, tmp_path, monkeypatch):
    """`python -m specrt.tools.bench_coupled` on the tiny engines: a row per drafter, temperature and way,
    every text equal to plain decoding's at its seed, and the report files."""
    import json

    import specrt.tools.bench_coupled as bench

    monkeypatch.setattr(bench, "prompt_texts", lambda mtbench, code: ["w5 w9 w23", "w40 w2"][: mtbench + code])
    out = tmp_path / "coupled"
    engines = ",".join(str(folders["engines"][k]) for k in KINDS)
    assert bench.main(["--engines", engines, "--temperatures", "1.0", "--mtbench", "1", "--code", "1",
                       "--max-new-tokens", "12", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["drafter"], r["way"]) for r in rows] == [(k, w) for k in KINDS for w in bench.WAYS]
    assert all(r["identical"] == r["prompts"] == 2 and r["tau"] >= 1.0 for r in rows)
    assert (out / "bench.png").stat().st_size > 0 and "coupled" in (out / "bench.md").read_text()
    with pytest.raises(SystemExit, match="temperatures > 0"):
        bench.main(["--engines", engines, "--temperatures", "0"])
