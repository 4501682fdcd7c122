"""`specrt bench` end to end on two MT-bench prompts with random drafters (the report, not the numbers)."""

from __future__ import annotations

import json

import torch

from specrt.export.checkpoints.drafters import save_drafter
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.tools.cli import main


def test_bench_writes_report_tables_and_plots(default_target, tmp_path, capsys):
    cfg = default_target.model.config
    torch.manual_seed(0)
    paths = {}
    for kind, drafter in {
        "dflash": DFlashDrafter(DFlashConfig.for_target(cfg, block_size=4, intermediate_size=128)),
        "dspark": DSparkDrafter(DSparkConfig.for_target(cfg, block_size=3, intermediate_size=128, markov_rank=16)),
    }.items():
        paths[kind] = tmp_path / kind
        save_drafter(drafter, paths[kind])
    out = tmp_path / "report"
    code = main(["bench", "--drafters", f"dflash={paths['dflash']},dspark={paths['dspark']}", "--prompts", "2",
                 "--max-new-tokens", "12", "--check-tokens", "8", "--speed-prompts", "1", "--speed-tokens", "4",
                 "--kv-contexts", "8,40", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    for kind in ("dflash+lookup", "dspark+lookup"):  # copies are grafted onto every drafter by default
        assert report["lossless"][kind] == {"identical": 2, "of": 2, "tokens_compared": 8, "against": "plain"}
        for mode in ("greedy", "t1"):
            assert report["acceptance"][mode][kind]["tau"] >= 1.0
    assert set(report["speed"]) == {"plain", "dflash+lookup", "dspark+lookup"}
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "speed.png").stat().st_size > 0
    assert set(report["kv"]) == {"8", "40"} and all(k["ms_per_step"] > 0 for k in report["kv"].values())
    assert "| dflash+lookup |" in capsys.readouterr().out


def test_heldout_prompts_are_the_trainers_validation_split(tmp_path):
    import argparse
    import gzip

    import pytest
    from specrt.plugins.errors import SpecrtError
    from specrt.tools.bench import bench_prompts
    from specrt.tools.build_data import DEFAULT_OUT, read_shards
    from specrt.tools.train_features import is_validation

    args = argparse.Namespace(prompt_source="heldout", data=None, prompts=5)
    prompts = bench_prompts(args, tokenizer=None, target_name="SmolLM2-135M-Instruct")
    samples = read_shards(DEFAULT_OUT)
    assert prompts == [s["prompt"] for s in samples if is_validation(s["id"])][:5]
    assert prompts != [s["prompt"] for s in samples][:5]  # not simply the first samples
    # a folder without held-out samples is refused with the fix
    (tmp_path / "shard_00000.json.gz").write_bytes(gzip.compress(b'{"ids":[],"prompt":[],"response":[]}'))
    with pytest.raises(SpecrtError, match="no held-out samples"):
        bench_prompts(argparse.Namespace(prompt_source="heldout", data=tmp_path, prompts=5), tokenizer=None)
    # ... and so is a set another target regenerated (its ids mean other tokens)
    with pytest.raises(SpecrtError, match="built for SmolLM2-135M-Instruct"):
        bench_prompts(args, tokenizer=None, target_name="Qwen3-0.6B")


def test_a_drafter_is_measured_against_the_fastest_plain_decoding_on_its_weights():
    from specrt.tools.bench import fastest_plain

    rates = {"plain": 40.0, "plain (target only)": 44.0, "plain@int4": 86.0,
             "plain@int4 (target only)": 87.0, "plain@int4 (target only, one row)": 93.0, "plain@w8a8": 70.0}
    assert fastest_plain("lookup@int4", rates) == "plain@int4 (target only, one row)"
    assert fastest_plain("eagle3+lookup", rates) == "plain (target only)"
    assert fastest_plain("lookup@w8a8", rates) == "plain@w8a8"
    assert fastest_plain("lookup@int8", rates) is None


def test_the_comparison_table_on_tiny_engines(tmp_path):
    """`bench_table` (what `specrt bench --compare` runs) on a tiny target-only folder, two prompt sets, no
    peers: the rows a user can pick there, greedy identical to plain decoding, ratios read against
    the plain row, the named choice measured against the automatic one, and the json / md / png."""
    from _onnx_tiny import make_sharp_target, write_hf_target
    from specrt.runtime.sampling import SamplingParams
    from specrt.tools import bench_table
    from specrt.tools.cli_export import main as export_main

    write_hf_target(tmp_path / "tiny", make_sharp_target())
    folder = tmp_path / "plain"
    assert export_main(["--drafter", "none", "--target", str(tmp_path / "tiny"), "--out", str(folder), "--quiet"]) == 0
    rows = bench_table.specrt_rows([folder], threads=1, twin_plain=True)
    labels = [r.label for r in rows]
    assert labels == ["specrt fp32 plain", "specrt fp32 copies alone", "specrt fp32 plain, second engine",
                      "specrt fp32 auto"]
    assert rows[2].plain == "specrt fp32 plain"  # read against plain decoding, prompt by prompt
    sets = {"mtbench": [[5, 9, 23, 5, 9], [7, 3, 11]], "code": [[4, 8, 15, 16, 4, 8, 15]]}
    report = bench_table.run_table(rows, sets, 10)
    assert report["reference"] == "specrt fp32 plain"
    for label, entry in report["rows"].items():
        for name, cell in entry["sets"].items():
            assert len(cell["tok_s_per_prompt"]) == len(sets[name]) and cell["median_tok_s"] > 0
            if label != "specrt fp32 plain":
                assert cell["identical"] == cell["of"] == len(sets[name]), (label, name)
    assert report["rows"]["specrt fp32 plain"]["sets"]["code"]["ratio"] == 1.0
    assert "slower" in report["rows"]["specrt fp32 copies alone"]["sets"]["mtbench"]  # named: measured
    assert "slower" not in report["rows"]["specrt fp32 auto"]["sets"]["mtbench"]
    paths = bench_table.write(tmp_path / "out", report)
    assert [p.name for p in paths] == ["compare.json", "compare.md", "compare.png"]
    md = paths[1].read_text()
    assert "| specrt fp32 auto |" in md and "MT-bench tok/s (median)" in md and "code (HumanEval)" in md
    assert paths[2].stat().st_size > 0
    assert "### where the time goes" in md and "| specrt fp32 auto | code (HumanEval) |" in md
    assert "| specrt fp32 plain, second engine |" in md.split("### against plain decoding")[1]
    assert "noise floor" in md

    # temperature 1: every row samples prompt n with seed 3 + n, seeded, so each is still plain's text
    sampled = bench_table.run_table(rows, sets, 10, SamplingParams(1.0, seed=3))
    assert sampled["sampling"] == {"temperature": 1.0, "seed": 3}
    for label, entry in sampled["rows"].items():
        for name, cell in entry["sets"].items():
            if label != "specrt fp32 plain":
                assert cell["identical"] == cell["of"] == len(sets[name]), (label, name)
    plain = rows[0]  # and it samples: some prompt's text differs from greedy's
    assert any(plain.run(p, 10, SamplingParams(1.0, seed=3 + n)).tokens != plain.run(p, 10, SamplingParams()).tokens
               for n, p in enumerate(sets["mtbench"] + sets["code"]))
    md = bench_table.render(sampled)
    assert "sampled at temperature 1 (no top-k / top-p), prompt n with seed 3 + n in every row" in md
    assert "same text as plain (same seed)" in md


def _fake_stats(rounds: int, draft: float, verify: float, host: float, round_tokens: int) -> "RequestStats":
    from specrt.runtime.stats import RequestStats

    return RequestStats(prompt_tokens=5, new_tokens=round_tokens + 1, rounds=rounds, round_tokens=round_tokens,
                        prefill_seconds=0.004, draft_seconds=draft, verify_seconds=verify, host_seconds=host)


def test_where_the_time_goes_is_the_median_per_round_of_each_requests_stats():
    """The cost split: per row and set, the median over prompts of each request's seconds / rounds (not
    the sums over the set), tau per request, the arms' rounds summed; peers have none."""
    from specrt.tools import bench_table
    from specrt.tools.bench_table import Row, RowRun

    # per prompt: (stats, arm rounds); medians of 3 prompts are the middle values per round
    runs = [(_fake_stats(10, 0.020, 0.100, 0.010, 30), {"eagle3+lookup": 8, "plain": 1}),  # 2 / 10 / 1 ms, tau 3
            (_fake_stats(4, 0.016, 0.080, 0.008, 4), {"lookup": 3}),  # 4 / 20 / 2 ms, tau 1
            (_fake_stats(100, 0.300, 0.700, 0.200, 250), {"eagle3+lookup": 99})]  # 3 / 7 / 2 ms, tau 2.5
    calls = iter(range(10**6))

    def drafted(prompt, max_new, sampling):
        i = next(calls)
        stats, arms = runs[(i - 1) % 3] if i else (_fake_stats(1, 0.0, 0.0, 0.0, 1), None)  # 0: warm-up
        return RowRun(list(prompt), stats.new_tokens, 0.5, stats, arms)

    def peer(prompt, max_new, sampling):
        return RowRun(None, 9, 0.5)

    rows = [Row("specrt int4 auto (eagle3)", drafted), Row("llama.cpp", peer, peer=True)]
    report = bench_table.run_table(rows, {"mtbench": [[1, 2], [3, 4], [5, 6]]}, 8)
    cell = report["rows"]["specrt int4 auto (eagle3)"]["sets"]["mtbench"]
    assert cell["cost"]["draft_ms_per_round"] == 3.0  # sums over the set would give 336 / 114 = 2.9 ms
    assert cell["cost"]["verify_ms_per_round"] == 10.0
    assert cell["cost"]["host_ms_per_round"] == 2.0
    assert cell["cost"]["tau"] == 2.5 and cell["cost"]["prefill_ms"] == 4.0 and cell["cost"]["rounds"] == 10
    assert cell["arm_rounds"] == {"eagle3+lookup": 107, "plain": 1, "lookup": 3}
    assert "cost" not in report["rows"]["llama.cpp"]["sets"]["mtbench"]
    md = bench_table.render(report)
    assert ("| specrt int4 auto (eagle3) | MT-bench | 2.50 | 3.0 | 10.0 | 2.0 | 4.0 | 62.0 "
            "| eagle3 + copies 96%, copies 3%, plain 1% |") in md
    assert "| llama.cpp | MT-bench |" not in md
    # a request that ended at prefill has no round: it counts for prefill only
    assert bench_table.cost_split([_fake_stats(0, 0.0, 0.0, 0.0, 0)])["draft_ms_per_round"] is None


def test_rows_are_compared_with_plain_decoding_prompt_by_prompt():
    """Against plain: the median of per-prompt tok/s ratios to the plain row on the same weights (not the
    ratio of medians), their range, and the prompts at least as fast; rows without a plain row have none."""
    from specrt.tools import bench_table
    from specrt.tools.bench_table import Row, RowRun

    # per prompt (warm-up first): plain's seconds and the drafter's; 10 new tokens each
    seconds = {"plain": iter([1.0, 1.0, 0.1, 1.0]), "drafted": iter([1.0, 0.5, 0.2, 1.25])}

    def row(name):
        def run(prompt, max_new, sampling):
            return RowRun(list(prompt), 10, next(seconds[name]))
        return run

    rows = [Row("specrt int4 plain", row("plain")), Row("specrt int4 auto", row("drafted"), plain="specrt int4 plain"),
            Row("llama.cpp", lambda p, m, s: RowRun(None, 10, 1.0), peer=True)]
    report = bench_table.run_table(rows, {"mtbench": [[1], [2], [3]]}, 10)
    # tok/s plain 10, 100, 10 and drafted 20, 50, 8: ratios 2.0, 0.5, 0.8 (medians of the rates: 20 / 10)
    found = bench_table.against_plain(report, "specrt int4 auto", "mtbench")
    assert found == {"median": 0.8, "low": 0.5, "high": 2.0, "at_least": 1, "of": 3}
    assert bench_table.against_plain(report, "specrt int4 plain", "mtbench") is None
    assert bench_table.against_plain(report, "llama.cpp", "mtbench") is None
    md = bench_table.render(report)
    assert "| specrt int4 auto | 0.80x | 0.50-2.00 | 1/3 |" in md and "| specrt int4 plain | " not in md.split(
        "prompt by prompt")[1]


def test_a_sampled_table_seeds_specrt_per_prompt_and_lets_the_peers_sample_at_that_temperature():
    """At temperature 1, prompt n of the run (sets in order) reaches every specrt row as seeded sampling
    with seed + n, and every peer as temperature 1 with that number for its own generator; the
    identical column counts, per prompt, the texts equal to plain's under the same seed."""
    from specrt.runtime.sampling import SamplingParams
    from specrt.tools import bench_table
    from specrt.tools.bench_table import Row, RowRun
    from specrt.tools.peers import PeerRun

    seen: dict[str, list] = {}

    def specrt_row(label, text_of):
        def run(prompt, max_new, sampling):
            seen.setdefault(label, []).append(sampling)
            return RowRun(text_of(prompt, sampling.seed), 3, 0.1)
        return Row(label, run, plain=None if label.endswith("plain") else "specrt int4 plain")

    seeded = lambda prompt, seed: [seed, *prompt]  # the text depends on prompt and seed only
    peer_calls = []
    peer = PeerRun("llama.cpp", lambda prompt, max_new, temperature, seed: peer_calls.append((temperature, seed)) or 3)
    rows = [specrt_row("specrt int4 plain", seeded), specrt_row("specrt int4 auto", seeded),
            specrt_row("specrt int4 clock-driven", lambda prompt, seed: [len(seen["specrt int4 plain"]) % 2, *prompt]),
            *bench_table.peer_rows([peer])]
    sets = {"mtbench": [[1], [2]], "code": [[3]]}
    report = bench_table.run_table(rows, sets, 4, SamplingParams(1.0, seed=7))
    for label in ("specrt int4 plain", "specrt int4 auto"):  # the warm-up, then prompts 0, 1, 2
        assert seen[label] == [SamplingParams(1.0, seed=s) for s in (7, 7, 8, 9)], label
    assert peer_calls == [(1.0, 7), (1.0, 7), (1.0, 8), (1.0, 9)]
    auto = report["rows"]["specrt int4 auto"]["sets"]
    assert (auto["mtbench"]["identical"], auto["code"]["identical"]) == (2, 1)
    clock = report["rows"]["specrt int4 clock-driven"]["sets"]
    assert clock["mtbench"]["identical"] + clock["code"]["identical"] < 3
    md = bench_table.render(report)
    assert "batch 1, sampled at temperature 1 (no top-k / top-p), prompt n with seed 7 + n in every row" in md
    assert "texts are their own samples" in md and "greedy identical" not in md
    # greedy stays greedy, and the peers refuse filters they would not apply
    bench_table.run_table(rows[:1], {"mtbench": [[1]]}, 4)
    assert seen["specrt int4 plain"][-1] == SamplingParams()
    import pytest

    with pytest.raises(ValueError, match="top-k and top-p off"):
        rows[-1].run([1], 4, SamplingParams(1.0, top_k=5))


def test_the_peers_sample_the_whole_distribution_at_a_temperature(monkeypatch, tmp_path):
    """What each peer is asked for: onnxruntime-genai do_sample, top_k 0, top_p 1 and the seed (its config
    defaults to top_k 50), llama.cpp temp with top_k 0, top_p 1, min_p 0 and set_seed; greedy otherwise."""
    import sys
    import types

    from specrt.tools import peers

    calls: list = []
    og = types.ModuleType("onnxruntime_genai")
    og.__version__ = "test"
    og.Model = lambda folder: "model"

    class GeneratorParams:
        def __init__(self, model):
            pass

        def set_search_options(self, **options):
            calls.append(("genai", options))

    class Generator:
        def __init__(self, model, params):
            self.made = 0

        def append_tokens(self, tokens):
            pass

        def is_done(self):
            return self.made >= 2

        def generate_next_token(self):
            self.made += 1

    og.GeneratorParams, og.Generator = GeneratorParams, Generator
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", og)
    monkeypatch.setattr(peers, "build_genai_model", lambda *a, **k: tmp_path)
    genai = peers.genai_peer(None, "int4", 2)
    assert genai.generate([1, 2], 4, 1.0, 11) == 2
    assert calls[-1] == ("genai", {"max_length": 6, "batch_size": 1, "do_sample": True, "top_k": 0, "top_p": 1.0,
                                   "temperature": 1.0, "random_seed": 11})
    genai.generate([1, 2], 4)
    assert calls[-1] == ("genai", {"max_length": 6, "batch_size": 1, "do_sample": False})

    llama_cpp = types.ModuleType("llama_cpp")
    llama_cpp.__version__, llama_cpp.LLAMA_DEFAULT_SEED = "test", 0xFFFFFFFF

    class Llama:
        def __init__(self, **kwargs):
            pass

        def token_eos(self):
            return 0

        def reset(self):
            pass

        def set_seed(self, seed):
            calls.append(("seed", seed))

        def generate(self, tokens, **sampling):
            calls.append(("llama", sampling))
            yield from (5, 6, 0)

    llama_cpp.Llama = Llama
    monkeypatch.setitem(sys.modules, "llama_cpp", llama_cpp)
    monkeypatch.setattr(peers, "llamacpp_smoke", lambda gguf, threads: None)
    llama = peers.llamacpp_peer(tmp_path / "m.gguf", 2, 64)
    assert llama.generate([1, 2], 4, 1.0, 11) == 2
    assert calls[-2:] == [("seed", 11), ("llama", {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                                   "typical_p": 1.0, "reset": True})]
    llama.generate([1, 2], 4)
    assert calls[-1] == ("llama", {"temp": 0.0, "top_k": 1, "reset": True})


def test_a_llamacpp_that_crashes_is_reported_not_run(monkeypatch, tmp_path):
    """A llama.cpp build that dies at its first decode (an AMX build where the machine grants no AMX
    state) is found in a child process: the peer is reported with the rebuild command, the bench goes on."""
    import subprocess
    import sys
    import types

    from specrt.tools import peers

    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    for code, err, wants in ((-11, "", ("signal 11", "GGML_NATIVE=OFF")), (1, "ValueError: bad magic\n", ("bad magic",))):
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, code, "", err))
        run = peers.llamacpp_peer(tmp_path / "m.gguf", 2, 64)
        assert run.generate is None and all(w in run.note for w in wants), run.note
