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
    rows = bench_table.specrt_rows([folder], 10, SamplingParams(0.0), threads=1)
    labels = [r.label for r in rows]
    assert labels == ["specrt fp32 plain", "specrt fp32 copies alone", "specrt fp32 auto"]
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
