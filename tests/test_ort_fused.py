"""The ORT-fused target graph (specrt.export.ort_fused): same function as the torch target, K/V written
in place, used for single streams; batches fall back to the portable graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from _onnx_tiny import TARGET_CFG, last_logits, make_drafters, make_sharp_target, make_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.plugins.errors import SpecrtError
from specrt.tools.cli_export import main as export_main
from specrt.export.manifest import load_manifest
from specrt.export.models.llama import LlamaModel
from specrt.export.ort_fused import GRAPH_NAME, build_graph, export_fused_target, supports
from specrt.runtime.backends.ort_backend import OrtTargetEngine
from specrt.runtime.backends.ort_models import OrtTargetModel
from specrt.runtime.backends.ort_session import OrtGraph, SessionOptions
from specrt.runtime.pipeline import Pipeline
from specrt.runtime.sampling import SamplingParams

pytest.importorskip("onnxruntime")

PROMPTS = [[5, 9, 23, 7], [3, 44, 12, 60, 8, 31, 2]]
# GroupQueryAttention wants head sizes in multiples of 16: the shared tiny target has 8
FUSED_CFG = TARGET_CFG.__class__(**{**TARGET_CFG.__dict__, "hidden_size": 64, "head_dim": 16})


def make_fused_target(seed: int = 0) -> LlamaModel:
    return make_target(FUSED_CFG, seed)


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-5) -> None:
    """Equal up to float rounding relative to the tensor's scale (random tiny targets grow large
    activations, where another summation order moves single elements by more than a fixed atol)."""
    err = float((got - want).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-6, f"max |diff| {err} for max |value| {float(want.abs().max())}"


def _fused_model(target: LlamaModel, folder) -> OrtTargetModel:
    graph = export_fused_target(target, folder)
    spec = {"inputs": graph.inputs, "outputs": graph.outputs}
    fused = OrtGraph(graph.path, spec, SessionOptions(threads=1))
    # the portable graph is never reached by these batch-1 calls: a sentinel that fails if it is
    return OrtTargetModel(_Unreachable(), target.config, target.tap_layers, torch.float32, fused)


class _Unreachable:
    device = torch.device("cpu")

    def run(self, *args, **kwargs):
        raise AssertionError("a batch-1 call fell back to the portable graph")


def test_prefill_and_tree_step_match_torch(tmp_path):
    target = make_fused_target()
    target.set_taps((0, 3, 6))
    fused = _fused_model(target, tmp_path)
    capacity = 40
    k_ref, v_ref = target.new_cache(1, capacity)
    k_ort, v_ort = fused.new_cache(1, capacity)
    ids = torch.tensor([[5, 9, 23, 7, 11, 40, 2, 18, 33, 61]])
    n = ids.shape[1]
    pos = torch.arange(n)[None]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
    with torch.no_grad():
        ref, ref_taps = target(ids, pos, causal, k_ref, v_ref, pos, torch.tensor([[n - 1]]))
    got, got_taps = fused(ids, pos, causal, k_ort, v_ort, pos, torch.tensor([[n - 1]]))
    assert_close_scaled(got, ref)
    assert_close_scaled(got_taps, ref_taps)
    # the graph wrote the prompt's K/V into the runtime's buffers, in place
    torch.testing.assert_close(k_ort[:, :, :, :n], k_ref[:, :, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_ort[:, :, :, :n], v_ref[:, :, :, :n], atol=1e-4, rtol=1e-4)
    assert k_ort[:, :, :, n:].abs().max() == 0  # and nothing beyond them
    # a tree step: anchor + children (parents -1, 0, 0, 1), positions by depth, ancestor mask
    parents, depths = [-1, 0, 0, 1], [0, 1, 1, 2]
    tree = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parents[j]
    mask = torch.zeros(1, 4, n + 4, dtype=torch.bool)
    mask[:, :, :n] = True
    mask[0, :, n:] = tree
    tree_ids = torch.tensor([[17, 4, 29, 50]])
    tree_pos = torch.tensor([[n + d for d in depths]])
    slots = torch.arange(n, n + 4)[None]
    rows = torch.arange(4)[None]
    with torch.no_grad():
        ref, ref_taps = target(tree_ids, tree_pos, mask, k_ref, v_ref, slots, rows)
    got, got_taps = fused(tree_ids, tree_pos, mask, k_ort, v_ort, slots, rows)
    assert_close_scaled(got, ref)
    assert_close_scaled(got_taps, ref_taps)
    torch.testing.assert_close(k_ort[:, :, :, : n + 4], k_ref[:, :, :, : n + 4], atol=1e-4, rtol=1e-4)
    assert fused.fused_calls == 2


def test_a_broken_tree_mask_changes_the_result(tmp_path):
    """The bias really carries the tree: hiding an ancestor changes that node's logits."""
    target = make_fused_target()
    fused = _fused_model(target, tmp_path)
    k, v = fused.new_cache(1, 16)
    ids = torch.tensor([[5, 9, 23]])
    full = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    slots = torch.arange(3)[None]
    a, _ = fused(ids, slots, full, k, v, slots)
    k2, v2 = fused.new_cache(1, 16)
    broken = full.clone()
    broken[0, 2, 1] = False
    b, _ = fused(ids, slots, broken, k2, v2, slots)
    torch.testing.assert_close(a[:, :2], b[:, :2])
    assert (a[0, 2] - b[0, 2]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def engine_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    target = make_sharp_target(FUSED_CFG)
    write_hf_target(root / "tiny", target)
    drafter = make_drafters(target)["eagle3"]
    save_drafter(drafter, root / "ckpt", dtype=torch.float32)
    base = ["--drafter", "eagle3", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt"), "--quiet"]
    assert export_main(base + ["--out", str(root / "with")]) == 0
    assert export_main(base + ["--out", str(root / "without"), "--no-ort-fused"]) == 0
    return root


def test_export_writes_the_fused_graph_and_marks_it_ort_only(engine_folders):
    data = load_manifest(engine_folders / "with").data
    entry = data["graphs"][GRAPH_NAME]
    assert entry["runtime"] == "onnxruntime" and data["graphs"]["target"]["runtime"] == "any"
    assert "target_ort" not in data["drafter"]["graphs"].values()
    names = {i["name"] for i in entry["inputs"]}
    assert {"attention_bias", "seqlens_k", "total_sequence_length", "past_key_0"} <= names
    assert GRAPH_NAME not in load_manifest(engine_folders / "without").data["graphs"]


def test_single_streams_run_fused_and_batches_the_portable_graph(engine_folders):
    ref = Pipeline.from_checkpoint(engine_folders / "tiny", drafter="eagle3", drafter_ckpt=engine_folders / "ckpt")
    pipe = Pipeline.from_engines(engine_folders / "with", threads=1)
    model = pipe.model
    assert model.fused is not None and not model.graph.loaded
    for prompt in PROMPTS:
        want = ref.generate_ids([prompt], 20, speculative=False).tokens
        assert pipe.generate_ids([prompt], 20, speculative=False).tokens == want
        assert pipe.generate_ids([prompt], 20).tokens == want  # speculative, verified on the fused graph
    assert model.fused_calls > 0 and not model.graph.loaded
    batched = pipe.generate_ids(PROMPTS, 20, speculative=False).tokens
    assert model.graph.loaded
    assert batched == ref.generate_ids(PROMPTS, 20, speculative=False).tokens


def test_folder_without_the_fused_graph_runs_portable(engine_folders):
    pipe = Pipeline.from_engines(engine_folders / "without", threads=1)
    assert pipe.model.fused is None
    got = pipe.generate_ids([PROMPTS[0]], 12).tokens
    want = Pipeline.from_engines(engine_folders / "with", threads=1).generate_ids([PROMPTS[0]], 12).tokens
    assert got == want


def test_qk_norm_targets_are_refused_with_the_way_out(tmp_path):
    target = LlamaModel(FUSED_CFG.__class__(**{**FUSED_CFG.__dict__, "qk_norm": True}))
    assert "q/k norms" in supports(target)
    assert "multiple of 16" in supports(make_target())  # the shared tiny target: head size 8
    with pytest.raises(SpecrtError, match="--no-ort-fused"):
        build_graph(target)


def test_gguf_blocks_of_a_fused_projection_are_found_part_by_part():
    """q|k|v concatenated along N: each part's GGUF blocks are looked up by its own hash."""
    from onnx import helper

    from specrt.export.gguf_quant import GgufBlocks, _concatenated_blocks, _weight_key, dequantize_blocks

    rng = np.random.default_rng(0)

    def blocks(rows, cols, name):
        codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        scales = rng.random((rows, cols // 32)).astype(np.float32)
        minima = -rng.random((rows, cols // 32)).astype(np.float32)
        return GgufBlocks(name, "Q4_1", codes, scales, minima, 4)

    parts = [blocks(8, 64, "q"), blocks(4, 64, "k"), blocks(4, 64, "v")]
    table = {_weight_key(dequantize_blocks(p).T): p for p in parts}
    weight = np.concatenate([dequantize_blocks(p).T for p in parts], axis=1)  # [K, N] as the graph stores it
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    assert _concatenated_blocks(node, weight, table) is None  # no part widths recorded: not a fused node
    entry = node.metadata_props.add()
    entry.key, entry.value = "specrt.parts", "8,4,4"
    found = _concatenated_blocks(node, weight, table)
    assert found is not None and found.codes.shape == (16, 64)
    np.testing.assert_array_equal(dequantize_blocks(found).T, weight)
    entry.value = "8,8"
    assert _concatenated_blocks(node, weight, table) is None  # wrong split: parts unknown


def export_int4(root, *extra: str):
    out = root / ("int4" + "".join(extra))
    assert export_main(["--drafter", "eagle3", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt"),
                        "--out", str(out), "--weights", "int4", "--quant-block", "16", "--quiet", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def int4_folder(engine_folders):
    return export_int4(engine_folders)


def test_int8_activation_engines_decode_bitwise_like_verify_steps(engine_folders, int4_folder):
    """--weights int4 (accuracy level 4): one-row calls run as two rows, EAGLE-3 drafts chains, and
    speculative greedy output equals plain greedy output on the same engine."""
    root = engine_folders
    out = int4_folder
    pipe = Pipeline.from_engines(out, threads=1)
    model = pipe.model
    assert model.two_row_decode and pipe.proposer.top_k == 1 and model.fused is not None
    graph = onnx.load(str(out / "target_ort.onnx"), load_external_data=False).graph
    assert not [n for n in graph.node if n.op_type == "Reshape"]  # the head's Reshapes folded (quantize.py)
    assert next(n for n in graph.node if "logits" in n.output).op_type == "MatMulNBits"
    assert all(n.input[1] == "" and n.input[2] == "" for n in graph.node if n.op_type == "GroupQueryAttention")
    assert not Pipeline.from_engines(root / "with", threads=1).model.two_row_decode  # fp32: not needed
    # logits of the last token: T=1 steps after a prompt == one multi-row call over the same tokens
    ids = [5, 9, 23, 7, 11, 40, 2, 18, 33, 61]
    many = last_logits(model, ids, 100)
    assert torch.equal(last_logits(model, ids, 1), many)
    for prompt in PROMPTS:
        assert pipe.generate_ids([prompt], 24).tokens == pipe.generate_ids([prompt], 24, speculative=False).tokens
    # no drafter loaded: one-row calls whose attention alone runs a second row, equally exact
    plain = Pipeline.from_engines(out, threads=1, drafter="none")
    assert plain.model.attention_row_decode and not plain.model.two_row_decode and plain.model.exact_decode
    calls = plain.model.fused_calls
    assert torch.equal(last_logits(plain.model, ids, 1), many)
    assert plain.model.fused_calls - calls == 7  # the prompt's call and six one-token calls, all fused
    for prompt in PROMPTS:
        assert plain.generate_ids([prompt], 24).tokens == pipe.generate_ids([prompt], 24).tokens
    # exact_plain=False: one-row calls (the fastest plain decoding), whose logits differ here
    fast = Pipeline.from_engines(out, threads=1, drafter="none", exact_plain=False)
    assert not fast.model.exact_decode
    assert not torch.equal(last_logits(fast.model, ids, 1), many)


def test_portable_int8_engines_do_not_pretend_to_be_exact(engine_folders):
    """Without target_ort the portable graph splits attention at the committed/new boundary, so a
    token's sums depend on how the context was fed and a copy row cannot make decoding reproduce a
    verify step (measured: logits differ): the runtime leaves such folders as they are."""
    pipe = Pipeline.from_engines(export_int4(engine_folders, "--no-ort-fused"), threads=1)
    assert pipe.model.fused is None and not pipe.model.two_row_decode
    assert pipe.proposer.top_k == 2  # the manifest's tree: no chain rule where it would not buy exactness


def test_the_target_spins_within_its_calls_and_drafter_graphs_never_spin(engine_folders):
    from specrt.runtime.backends.ort_backend import load_engines

    drafted = load_engines(engine_folders / "with", SessionOptions(threads=1))
    assert drafted.target.fused.options.spinning is True  # as without a drafter: the next call finds it awake
    assert drafted.drafter.fc_graph.options.spinning is False
    plain = load_engines(engine_folders / "with", SessionOptions(threads=1), with_drafter=False)
    assert plain.target.fused.options.spinning is True
    forced = load_engines(engine_folders / "with", SessionOptions(threads=1, spinning=False), with_drafter=False)
    assert forced.target.fused.options.spinning is False  # an explicit choice is kept


# --- single-stream calls through the bound call (specrt.runtime.backends.ort_decode) -----------------
LEAN_PROMPTS = PROMPTS + [[17]]  # a one-token prompt: its prefill is a one-token call
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)
FOLDERS = {"fp32": lambda root, int4: root / "with", "int4": lambda root, int4: int4}


def general_calls(monkeypatch) -> list[int]:
    """Counts the forwards that take the general fused path (the bound call does not)."""
    calls = []
    original = OrtTargetModel._call_fused

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OrtTargetModel, "_call_fused", counted)
    return calls


def generate(pipe: Pipeline, lean: bool, prompt, sampling=None, tokens: int = 24):
    engine = pipe.engine_for(len(prompt) + tokens)
    engine.lean_decode = lean
    return pipe.generate_ids([prompt], tokens, sampling).tokens[0]


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_bound_call_gives_the_general_paths_tokens(engine_folders, int4_folder, kind, monkeypatch):
    pipe = Pipeline.from_engines(FOLDERS[kind](engine_folders, int4_folder), threads=1, drafter="none")
    assert pipe.model.fused is not None and pipe.model.attention_row_decode == (kind == "int4")
    calls = general_calls(monkeypatch)
    graph = pipe.model.fused
    for prompt in LEAN_PROMPTS:
        for sampling in (None, SAMPLED):
            want = generate(pipe, False, prompt, sampling)
            calls.clear()
            runs = graph.run_calls
            got = generate(pipe, True, prompt, sampling)
            assert got == want
            # one session run per token (the prompt's gives the first), none through the general path
            assert graph.run_calls - runs == len(got) and not calls
            call = pipe.engine_for(1)._bound  # greedy steps asked for the argmax alone, sampled ones the logits
            assert (call.bound_logits == (call.argmax_logits.ctypes.data, 1)) == (sampling is None)


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_plain_steps_take_the_engines_one_token_call(engine_folders, int4_folder, kind, monkeypatch):
    """A lone row's plain step runs `decode_one` (no id, position or mask tensors): after the
    prompt's forward, no step calls `forward`, and the text is the general path's."""
    pipe = Pipeline.from_engines(FOLDERS[kind](engine_folders, int4_folder), threads=1, drafter="none")
    forwards = []
    original = OrtTargetEngine.forward

    def counted(self, input_ids, *args, **kwargs):
        forwards.append(int(input_ids.shape[1]))
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(OrtTargetEngine, "forward", counted)
    prompt = LEAN_PROMPTS[0]
    want = generate(pipe, False, prompt)
    assert forwards.count(1) == len(want) - 1  # the general path: one forward per step
    forwards.clear()
    assert generate(pipe, True, prompt) == want
    assert forwards == [len(prompt)]  # the prompt's forward alone


def test_plain_rounds_of_auto_keep_the_taps(engine_folders, monkeypatch):
    """`decode_one` hands back the step's taps: auto's plain rounds on an EAGLE-3 folder (its
    drafter ingests every step's features) take it and give the general path's text."""
    pipe = Pipeline.from_engines(engine_folders / "with", threads=1, drafter="auto")
    taken = []
    original = OrtTargetEngine.decode_one

    def counted(self, token, argmax=False):
        out = original(self, token, argmax)
        taken.append(out is not None and out[1] is not None)
        return out

    monkeypatch.setattr(OrtTargetEngine, "decode_one", counted)
    for prompt in LEAN_PROMPTS:
        assert generate(pipe, True, prompt, tokens=20) == generate(pipe, False, prompt, tokens=20)
    assert any(taken)  # some rounds were plain, and their taps came back


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_bound_call_logits_are_bitwise_the_general_paths(engine_folders, int4_folder, kind):
    """Logits of every step, attention rows included; the last step fills the cache, where attention
    rows have no spare slot and both paths make a one-row call. A step's logits outlive the next call."""
    from specrt.runtime.engine import causal_mask

    pipe = Pipeline.from_engines(FOLDERS[kind](engine_folders, int4_folder), threads=1, drafter="none")
    prompt = LEAN_PROMPTS[1]
    engines = [pipe._engine_factory(len(prompt) + 5, 1, 0) for _ in range(2)]  # no spare slots
    engines[1].lean_decode = False
    steps = []
    for engine in engines:
        engine.reset(1)
        engine.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], causal_mask(1, len(prompt)))
        engine.commit(0, range(len(prompt)))
        logits = []
        for token in (4, 50, 9, 33, 21):
            position = engine.lengths.clone()[:, None]
            out, _ = engine.forward(torch.tensor([[token]]), position, torch.ones(1, 1, 1, dtype=torch.bool))
            engine.commit(0, [0])
            logits.append(out)
        steps.append(logits)
    assert engines[0]._bound is not None and engines[1]._bound is None
    for lean, general in zip(*steps):
        assert torch.equal(lean, general)
    assert len({t.data_ptr() for t in steps[0]}) == len(steps[0])  # kept logits are never written over


def test_bound_call_reuses_logits_only_once_nothing_holds_them(int4_folder):
    """A released logits tensor is written again by the next call; one held (itself, a view of a row,
    or a numpy array of it) keeps its values and the call takes a fresh one."""
    from specrt.runtime.engine import causal_mask

    pipe = Pipeline.from_engines(int4_folder, threads=1, drafter="none")
    engine = pipe._engine_factory(64, 1, 0)
    engine.reset(1)
    prompt = LEAN_PROMPTS[0]
    engine.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], causal_mask(1, len(prompt)))
    engine.commit(0, range(len(prompt)))
    logits, _ = engine.decode_one(5)
    address = logits.data_ptr()
    del logits
    logits, _ = engine.decode_one(9)
    assert logits.data_ptr() == address  # released: reused
    for hold in (lambda t: t, lambda t: t[0, 0], lambda t: t.numpy()):
        kept = hold(logits)
        want = torch.as_tensor(kept).clone()
        logits, _ = engine.decode_one(23)
        assert logits.data_ptr() != torch.as_tensor(kept).data_ptr()
        assert torch.equal(torch.as_tensor(kept), want)
        del kept


def test_speculative_steps_on_the_bound_call_match_plain(int4_folder, monkeypatch):
    """Copies verified on int4 (two-row decoding: one-token steps carry a second row): verify steps
    of several tokens and one-token steps both take the bound call, and the text is plain decoding's."""
    pipe = Pipeline.from_engines(int4_folder, threads=1, drafter="lookup")
    plain = Pipeline.from_engines(int4_folder, threads=1, drafter="none")
    assert pipe.model.two_row_decode and pipe.model.takes_attention_rows
    calls = general_calls(monkeypatch)
    repetitive = [5, 9, 23, 7, 5, 9, 23, 7, 5, 9, 23]  # copies find matches
    for prompt in LEAN_PROMPTS + [repetitive]:
        want = generate(plain, False, prompt, tokens=32)
        assert generate(pipe, False, prompt, tokens=32) == want
        calls.clear()
        assert generate(pipe, True, prompt, tokens=32) == want
        assert not calls


def test_bound_calls_give_the_general_paths_speculative_text(engine_folders):
    """EAGLE-3 on the fused graph: prefill, verify and one-token steps through the bound call
    (`specrt.runtime.backends.ort_decode`, taps included) give the general path's tokens."""
    pipe = Pipeline.from_engines(engine_folders / "with", threads=1)
    for prompt in LEAN_PROMPTS:
        engine = pipe.engine_for(len(prompt) + 20)
        engine.lean_decode = False
        want = pipe.generate_ids([prompt], 20).tokens
        engine.lean_decode = True
        assert pipe.generate_ids([prompt], 20).tokens == want
        assert engine._bound is not None and engine._bound.taps


# --- the causal twin (target_ort_causal): plain decoding in one-row steps -----------------------------
def fused_model_of(folder, name: str) -> OrtTargetModel:
    manifest = load_manifest(folder)
    graph = OrtGraph(manifest.graph_path(name), manifest.graphs[name], SessionOptions(threads=1))
    return OrtTargetModel(_Unreachable(), manifest.target_config, [], torch.float32, graph)


def causal_run(engine: OrtTargetEngine, tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` appended causally after the row's committed ones, then committed."""
    from specrt.runtime.engine import causal_mask

    start = int(engine.lengths[0])
    t = len(tokens)
    logits, _ = engine.forward(torch.tensor([tokens]), torch.arange(start, start + t)[None], causal_mask(1, t))
    engine.commit(0, range(t))
    return logits


@pytest.mark.parametrize("kind", ["fp32", "int4"])
@pytest.mark.parametrize("lean", [True, False])
def test_the_causal_twin_gives_target_orts_logits_bitwise(engine_folders, int4_folder, kind, lean):
    """A prompt, one-token steps and a chain: the same logits and cache from both graphs, bitwise."""
    folder = FOLDERS[kind](engine_folders, int4_folder)
    engines = []
    for name in ("target_ort", "target_ort_causal"):
        engine = OrtTargetEngine(fused_model_of(folder, name), 64)
        engine.lean_decode = lean
        engine.reset(1)
        engines.append(engine)
    assert engines[1].model.causal_only and not engines[0].model.causal_only
    for tokens in ([5, 9, 23, 7, 11], [40], [2], [18, 33, 61], [4]):
        general, causal = (causal_run(engine, tokens) for engine in engines)
        assert torch.equal(causal, general)
    assert torch.equal(engines[0].k_cache, engines[1].k_cache) and torch.equal(engines[0].v_cache, engines[1].v_cache)


def test_plain_one_row_decoding_loads_the_causal_twin(engine_folders, int4_folder, tmp_path):
    import json
    import shutil

    def graph_of(folder, **kw) -> str:
        return Pipeline.from_engines(folder, threads=1, verify_checksums=False, **kw).model.fused.path.stem

    fp32 = engine_folders / "with"
    assert graph_of(fp32, drafter="none") == "target_ort_causal"  # fp32 plain steps are one-row calls
    assert graph_of(int4_folder, drafter="none", exact_plain=False) == "target_ort_causal"
    assert graph_of(int4_folder, drafter="none") == "target_ort"  # attention rows: speculation's rounding
    for drafter in ("auto", "lookup", "eagle3"):  # verify steps of drafts
        assert graph_of(fp32, drafter=drafter) == "target_ort"
    # a folder exported before the twin keeps target_ort
    old = tmp_path / "old"
    shutil.copytree(fp32, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["graphs"]["target_ort_causal"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert graph_of(old, drafter="none") == "target_ort"


def test_calls_the_causal_twin_cannot_express_take_the_portable_graph(engine_folders):
    """A tree step on a plain pipeline (e.g. one given a proposer later): the portable graph answers."""
    plain = Pipeline.from_engines(engine_folders / "with", threads=1, drafter="none")
    general = Pipeline.from_engines(engine_folders / "with", threads=1, drafter="auto")
    assert plain.model.causal_only and not plain.model.graph.loaded
    outs = []
    for pipe in (plain, general):
        engine = pipe._engine_factory(32, 1, 0)
        engine.reset(1)
        causal_run(engine, [5, 9, 23, 7])
        # root, two children of the root, a grandchild of the first: not causal
        tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
        logits, _ = engine.forward(torch.tensor([[11, 40, 2, 18]]), torch.tensor([[4, 5, 5, 6]]), tree)
        outs.append(logits)
    assert plain.model.graph.loaded
    assert_close_scaled(outs[0], outs[1])


def test_fast_plain_needs_plain_decoding_on_an_engine_folder(engine_folders):
    import argparse

    from specrt.tools.cli_generate import add_arguments, build_pipeline

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engines", str(engine_folders / "with"), "--fast-plain", "--threads", "1"])
    with pytest.raises(SpecrtError, match="--drafter none"):
        build_pipeline(args, None)
    args = parser.parse_args(["--engines", str(engine_folders / "with"), "--fast-plain", "--drafter", "none",
                              "--threads", "1"])
    assert build_pipeline(args, None).model.causal_only
