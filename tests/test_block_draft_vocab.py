"""DFlash/DSpark block heads over a reduced draft vocabulary (`specrt export --draft-vocab N`): the
reduced head computes the full head's logits on its rows, greedy output stays plain decoding's, the
sampled draft law lives on the reduced set and sampling keeps the target's distribution, and a
folder whose mapping is missing, corrupt or dropped from the manifest is refused."""

from __future__ import annotations

import gzip
import json
import logging
import shutil

import numpy as np
import pytest
import torch

from _onnx_tiny import randomize, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.export.manifest import record_files
from specrt.plugins.errors import SpecrtError
from specrt.runtime.pipeline import Pipeline
from specrt.runtime.sampling import SamplingParams
from specrt.tools.cli_export import main as export_main

pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)

KINDS = ("dflash", "dspark")
PROMPTS = [[0, 4, 2, 3], [3, 4, 2, 0, 2, 3, 2], [4]]
VOCAB = 6  # test_speculative's exact-distribution check enumerates this many tokens
KEEP = 3  # the end-of-sequence id (1) and the two most frequent tokens of the data (2, 3)


def write_data_set(folder, responses) -> None:
    """A built data set (`specrt train data` layout): one shard of prompt / response ids."""
    folder.mkdir(parents=True)
    payload = {"ids": [f"s{i}" for i in range(len(responses))], "prompt": [[3, 4]] * len(responses),
               "response": responses}
    (folder / "shard_00000.json.gz").write_bytes(gzip.compress(json.dumps(payload).encode()))


def export(args) -> None:
    assert export_main([*args, "--quiet", "--no-lookup-files", "--no-ort-fused"]) == 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One reduced-vocabulary engine folder per kind (test_speculative's 6-token target, sharp enough
    that greedy paths have no near-ties), with the torch models."""
    from test_speculative import tiny_target

    from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
    from specrt.export.models.dspark import DSparkConfig, DSparkDrafter

    root = tmp_path_factory.mktemp("vocab")
    target = tiny_target(vocab=VOCAB, seed=3)
    write_hf_target(root / "tiny", target)  # its config and tokenizer end sequences with id 1
    write_data_set(root / "data", [[2, 3, 2, 3, 0, 5, 0, 5, 2, 3, 4]])  # what this target writes
    shape = dict(num_layers=1, block_size=4, num_taps=3, intermediate_size=40)
    drafters = {"dflash": DFlashDrafter(DFlashConfig.for_target(target.config, **shape)),
                "dspark": DSparkDrafter(DSparkConfig.for_target(target.config, markov_rank=8, **shape))}
    out = {"root": root, "target": target, "drafters": drafters}
    for kind in KINDS:
        randomize(drafters[kind], 4)
        drafters[kind].init_from_target(target)  # drafts the target sometimes accepts
        drafters[kind].bind_target(target.embed_tokens, target.lm_head)
        save_drafter(drafters[kind], root / f"ckpt-{kind}", dtype=torch.float32)
        export(["--drafter", kind, "--target", str(root / "tiny"), "--drafter-ckpt", str(root / f"ckpt-{kind}"),
                "--out", str(root / kind), "--draft-vocab", str(KEEP), "--draft-vocab-data", str(root / "data")])
        out[kind] = root / kind
    return out


def kept_ids(folder) -> np.ndarray:
    return np.load(folder / "draft_to_target.npy")


def block_feeds(drafter, kind: str, batch: int = 2, past: int = 6, capacity: int = 12):
    g = torch.Generator().manual_seed(5)
    cfg = drafter.config
    bk = cfg.block_size
    feeds = {"block_ids": torch.randint(0, VOCAB, (batch, bk), generator=g),
             "position_ids": past + torch.arange(bk).expand(batch, bk).contiguous(),
             "past_mask": torch.rand(batch, bk, past, generator=g) > 0.2}
    feeds["block_ids"][:, 1:] = cfg.mask_token_id
    for i in range(cfg.num_layers):
        for name in ("key", "value"):
            feeds[f"past_{name}_{i}"] = torch.randn(batch, cfg.num_kv_heads, capacity, cfg.head_dim, generator=g)
    if kind == "dspark":
        feeds.update(temperature=torch.zeros(batch), gumbel=torch.zeros(batch, bk, VOCAB),
                     threshold=torch.tensor(0.0), sps=torch.ones(1))
    return feeds


@pytest.mark.parametrize("kind", KINDS)
def test_the_reduced_head_computes_the_full_heads_logits_on_its_rows(folders, kind):
    """The exported reduced block graph against the full-vocabulary block graph (its torch wrapper)."""
    from specrt.export.onnx_export import DFlashBlockGraph, DSparkBlockGraph
    from specrt.runtime.backends.ort_backend import load_engines

    ids = kept_ids(folders[kind])
    manifest = json.loads((folders[kind] / "manifest.json").read_text())
    record = manifest["drafter"]["draft_vocab"]
    assert record["size"] == KEEP == len(ids) and record["file"] == "draft_to_target.npy"
    assert ids.tolist() == [1, 2, 3]  # the end-of-sequence id is kept whatever its count
    assert "draft_to_target.npy" in manifest["files"]
    reduced = load_engines(folders[kind]).drafter
    assert reduced.draft_vocab.size == KEEP
    feeds = block_feeds(reduced, kind)
    full_graph = (DSparkBlockGraph if kind == "dspark" else DFlashBlockGraph)(folders["drafters"][kind]).eval()

    def full(**changes):
        with torch.no_grad():
            return full_graph(*{**feeds, **changes}.values())

    if kind == "dflash":
        got = reduced.block_graph.run(feeds)["logits"]
        assert got.shape[-1] == KEEP
        torch.testing.assert_close(got, full()[0][..., ids], rtol=1e-4, atol=1e-4)
        return
    # DSpark: the full graph confined to the kept rows (Gumbel-max with -inf-like noise elsewhere) drafts
    # what the reduced graph drafts at temperature 0, with the same Markov logits and confidences
    outside = torch.full((VOCAB,), -1e4)
    outside[ids] = 0.0
    tokens, markov_logits, conf_logits, _, _ = full(temperature=torch.ones(2), gumbel=outside.expand(2, 4, VOCAB))
    confined = {"tokens": tokens, "markov_logits": markov_logits, "conf_logits": conf_logits}
    got = reduced.block_graph.run({**feeds, "gumbel": torch.zeros(2, 4, KEEP)})
    assert got["tokens"].tolist() == confined["tokens"].tolist()
    assert set(got["tokens"].flatten().tolist()) <= set(ids.tolist())
    torch.testing.assert_close(got["markov_logits"], confined["markov_logits"][..., ids], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["conf_logits"], confined["conf_logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_with_a_reduced_vocabulary_equals_plain_decoding(folders, kind, monkeypatch):
    from specrt.export.draft_options import DraftOptions
    from specrt.runtime.backends.ort_models import OrtBlockDrafter

    ids = torch.from_numpy(kept_ids(folders[kind]))
    plain = Pipeline.from_engines(folders[kind], drafter="none").generate_ids(PROMPTS, 24)
    pipe = Pipeline.from_engines(folders[kind], drafter=kind, draft_options=DraftOptions(lookup=0), measured=False)
    logits, drafted = [], []
    call = OrtBlockDrafter.__call__

    def spy_call(self, *args):  # DFlash: the block's logits over the kept ids
        out = call(self, *args)
        logits.append(out[0])
        return out

    monkeypatch.setattr(OrtBlockDrafter, "__call__", spy_call)
    propose = pipe.proposer.propose

    def spy(*args, **kwargs):
        out = propose(*args, **kwargs)
        drafted.append([p.tokens.tolist() for p in out])
        return out

    pipe.proposer.propose = spy
    for i, prompt in enumerate(PROMPTS):
        assert pipe.generate_ids([prompt], 24).tokens[0] == plain.tokens[i]
    assert sum(len(t) for row in drafted for t in row) and set().union(*(t for row in drafted for t in row)) <= set(
        ids.tolist())
    if kind == "dflash":  # each draft is the target id of its position's best kept row
        for block, rows in zip(logits, drafted):
            want = ids[block[0, 1:].argmax(-1)].tolist()
            assert rows[0] == want[:len(rows[0])]
    assert pipe.generate_ids(PROMPTS, 24).tokens == plain.tokens
    if kind == "dflash":  # trees map their nodes too
        tree = Pipeline.from_engines(folders[kind], drafter=kind, measured=False,
                                     draft_options=DraftOptions(lookup=0, tree_tokens=8, block_tree_top_k=3))
        assert tree.generate_ids(PROMPTS, 24).tokens == plain.tokens


@pytest.mark.parametrize("kind", KINDS)
def test_the_sampled_draft_law_lives_on_the_reduced_set(folders, kind):
    from specrt.runtime.backends.ort_backend import load_engines
    from specrt.runtime.proposers.block import BlockProposer

    ids = torch.from_numpy(kept_ids(folders[kind]))
    engines = load_engines(folders[kind])
    proposer = BlockProposer(engines.drafter)
    proposer.reset(2, 32)
    g = torch.Generator().manual_seed(0)
    taps = [torch.randn(5, 3 * 32, generator=g), torch.randn(3, 3 * 32, generator=g)]
    proposer.observe([0, 1], [[0, 4, 2, 3, 4], [3, 4, 2]], taps, [3, 2])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    for p in proposer.propose([0, 1], [3, 2], SamplingParams(temperature=4.0, seed=3), g):
        assert p.draft_probs.shape[-1] == VOCAB
        assert float(p.draft_probs[:, outside].abs().sum()) == 0.0
        torch.testing.assert_close(p.draft_probs.sum(-1), torch.ones(len(p.tokens)))
        assert bool(torch.isin(p.tokens, ids).all())
        assert bool((p.draft_probs[torch.arange(len(p.tokens)), p.tokens] > 0).all())  # drawn from that law


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_with_a_reduced_vocabulary_keeps_the_target_distribution(folders, kind):
    """test_speculative's exact-distribution check (first 3 tokens, 6000 samples, chi-square) with the
    engine's reduced-vocabulary drafter proposing for the torch target it was exported from."""
    from test_speculative import chi_square_pvalue, exact_first_tokens, sampled

    from specrt.runtime.backends.ort_backend import load_engines
    from specrt.runtime.proposers.block import BlockProposer

    target = folders["target"]
    # test_speculative's law (its small target is this one with a 4x flatter head, at T 0.9)
    params = SamplingParams(temperature=3.6, top_k=5, seed=1234)
    prompt = [1, 4, 2]
    exact = exact_first_tokens(target, prompt, params, 3)
    got = sampled(target, BlockProposer(load_engines(folders[kind]).drafter), prompt, params, 3)
    assert chi_square_pvalue(got, exact, 3) > 1e-3


def copy_of(folder, tmp_path):
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def without_manifest_entry(folder, out, *keys):
    """A copy of folder whose manifest.json lacks manifest[keys[0]]...[keys[-1]]."""
    copied = copy_of(folder, out)
    manifest = json.loads((copied / "manifest.json").read_text())
    parent = manifest
    for key in keys[:-1]:
        parent = parent[key]
    del parent[keys[-1]]
    (copied / "manifest.json").write_text(json.dumps(manifest))
    return copied


def test_a_missing_corrupt_or_dropped_mapping_is_refused(folders, tmp_path):
    from specrt.runtime.backends.ort_backend import load_engines

    reduced = folders["dflash"]
    missing = copy_of(reduced, tmp_path / "missing")
    (missing / "draft_to_target.npy").unlink()
    with pytest.raises(SpecrtError, match="draft_to_target.npy is missing"):
        load_engines(missing)

    corrupt = copy_of(reduced, tmp_path / "corrupt")
    data = bytearray((corrupt / "draft_to_target.npy").read_bytes())
    data[-1] ^= 0xFF
    (corrupt / "draft_to_target.npy").write_bytes(bytes(data))
    with pytest.raises(SpecrtError, match="draft_to_target.npy is corrupt"):
        load_engines(corrupt)

    unlisted = without_manifest_entry(reduced, tmp_path / "unlisted", "files", "draft_to_target.npy")
    with pytest.raises(SpecrtError, match="draft_to_target.npy is used but has no checksum"):
        load_engines(unlisted)

    # checksummed, but not a vocabulary (duplicates): refused by what it holds
    wrong = copy_of(reduced, tmp_path / "wrong")
    ids = np.load(wrong / "draft_to_target.npy")
    ids[1] = ids[0]
    np.save(wrong / "draft_to_target.npy", ids)
    record_files(wrong, ["draft_to_target.npy"])
    with pytest.raises(SpecrtError, match="not ascending unique target ids"):
        load_engines(wrong)

    # the manifest no longer names the mapping: the reduced head is not read as the full vocabulary
    dropped = without_manifest_entry(reduced, tmp_path / "dropped", "drafter", "draft_vocab")
    with pytest.raises(SpecrtError, match=f"logits cover {KEEP} tokens"):
        load_engines(dropped)


def test_the_export_flags_are_checked(folders, tmp_path, capsys):
    from specrt.export.export import most_frequent_tokens

    root = folders["root"]
    # EAGLE-3 brings its own vocabulary; refused before anything is loaded
    assert export_main(["--drafter", "eagle3", "--target", str(root / "tiny"), "--draft-vocab", "8", "--out",
                        str(tmp_path / "e")]) == 2
    assert "--draft-vocab applies to DFlash/DSpark" in capsys.readouterr().err
    # no counts for this target: none shipped, no --draft-vocab-data
    assert export_main(["--drafter", "dflash", "--target", str(root / "tiny"), "--drafter-ckpt",
                        str(root / "ckpt-dflash"), "--draft-vocab", "8", "--out", str(tmp_path / "d"), "--quiet"]) == 2
    assert "--draft-vocab-data" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "d").exists()
    ids, coverage = most_frequent_tokens([0, 5, 1, 9, 9, 0, 2], 3, always=[0])
    assert ids.tolist() == [0, 3, 4] and coverage == pytest.approx(18 / 26)  # ties: the lower id first
    with pytest.raises(SpecrtError, match="does not reduce"):
        most_frequent_tokens([1, 2, 3], 3)
