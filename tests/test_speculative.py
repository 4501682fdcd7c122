"""The speculative loop on the torch backend: greedy equals plain decoding, sampling keeps the
target's distribution, for every drafter kind, batch 1 and batch > 1."""

from __future__ import annotations

import pytest
import torch

from specrt.export.models import LlamaConfig, LlamaModel
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.generate import generate_autoregressive
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.proposers.block import BlockProposer
from specrt.runtime.proposers.eagle3 import Eagle3Proposer
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import generate_speculative

VOCAB = 61


def tiny_target(vocab: int = VOCAB, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=512, rope_theta=10000.0)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():  # sharper distributions than init gives, so greedy paths are not flat ties
        model.lm_head.weight.mul_(8.0)
    return model


def eagle3(target: LlamaModel, draft_vocab: int | None = None, seed: int = 1, top_k: int = 3,
           threshold: float = 0.0) -> Eagle3Proposer:
    torch.manual_seed(seed)
    draft_vocab = draft_vocab or target.config.vocab_size
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, draft_vocab)).eval()
    if draft_vocab < target.config.vocab_size:  # a scattered draft vocabulary exercises d2t
        chosen = torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values
        drafter.d2t.copy_(chosen - torch.arange(draft_vocab))
        drafter.t2d.zero_()
        drafter.t2d[chosen] = True
    drafter.bind_target_embedding(target.embed_tokens)
    return Eagle3Proposer(drafter, top_k=top_k, depth=4, total_tokens=10, threshold=threshold)


def block(target: LlamaModel, kind: str, seed: int = 2, threshold: float = 0.0, max_drafts: int | None = None,
          tree_top_k: int = 1, tree_tokens: int = 10, markov_variant: str = "vanilla") -> BlockProposer:
    torch.manual_seed(seed)
    if kind == "dflash":
        drafter = DFlashDrafter(DFlashConfig.for_target(target.config, num_layers=1, block_size=5, num_taps=3))
    else:
        drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=1, block_size=5, num_taps=3,
                                                        markov_rank=16, markov_variant=markov_variant))
    drafter.init_from_target(target)
    drafter.bind_target(target.embed_tokens, target.lm_head)
    return BlockProposer(drafter.eval(), threshold=threshold, max_drafts=max_drafts, tree_top_k=tree_top_k,
                         tree_tokens=tree_tokens)


class OracleProposer:
    """Proposes the target's own greedy continuation (known in advance): every draft is accepted.

    As a tree it also adds a wrong sibling at every level, so the accepted path is not always node 0.
    """

    def __init__(self, continuations: list[list[int]], prompt_lengths: list[int], k: int, tree: bool) -> None:
        self.name, self.tap_layers, self.max_drafts = "oracle", (), 2 * k
        self.continuations, self.prompt_lengths, self.k, self.tree = continuations, prompt_lengths, k, tree

    def reset(self, batch_size: int, capacity: int) -> None:
        self.lengths = [0] * batch_size

    def context_length(self, row: int) -> int:
        return self.lengths[row]

    def observe(self, rows, tokens, taps, next_tokens) -> None:
        for b, t in zip(rows, tokens):
            self.lengths[b] += len(t)

    def propose(self, rows, anchors, sampling, generator) -> list[Proposal]:
        out = []
        for b in rows:
            done = self.lengths[b] - self.prompt_lengths[b] + 1  # tokens emitted so far (anchor included)
            right = self.continuations[b][done:done + self.k]
            if not self.tree:
                out.append(Proposal.chain(torch.tensor(right, dtype=torch.long)))
                continue
            tokens, parents, prev = [], [], -1
            for tok in right:
                tokens += [(tok + 1) % VOCAB, tok]  # wrong sibling first, then the right one
                parents += [prev, prev]
                prev = len(tokens) - 1
            out.append(Proposal(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                                None, is_chain=False, depth=len(right)))
        return out


PROMPTS = [[5, 9, 13, 2, 7, 40], [11, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def plain(target, prompts, n, sampling=SamplingParams()):
    return generate_autoregressive(TorchTargetEngine(target, 128, len(prompts)), prompts, n, sampling).tokens


@pytest.mark.parametrize("make", [
    lambda t: eagle3(t), lambda t: eagle3(t, draft_vocab=40), lambda t: block(t, "dflash"),
    lambda t: block(t, "dspark"), lambda t: block(t, "dspark", threshold=0.2),
    lambda t: block(t, "dflash", threshold=0.05, max_drafts=2), lambda t: eagle3(t, draft_vocab=40, top_k=1),
    lambda t: eagle3(t, top_k=1, threshold=0.3), lambda t: block(t, "dflash", tree_top_k=3),
    lambda t: block(t, "dspark", tree_top_k=3), lambda t: block(t, "dspark", tree_top_k=2, markov_variant="gru"),
], ids=["eagle3", "eagle3-draftvocab", "dflash", "dspark", "dspark-truncated", "dflash-capped", "eagle3-chain",
        "eagle3-chain-truncated", "dflash-tree", "dspark-tree", "dspark-gru-tree"])
@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batch3"])
def test_greedy_equals_plain_decoding(target, make, batched):
    proposer = make(target)
    for n in (1, 7, 40):
        expected = plain(target, PROMPTS, n)
        if batched:
            engine = TorchTargetEngine(target, 128, len(PROMPTS))
            got = generate_speculative(engine, proposer, PROMPTS, n, SamplingParams()).tokens
        else:
            got = [generate_speculative(TorchTargetEngine(target, 128), proposer, [p], n, SamplingParams()).tokens[0]
                   for p in PROMPTS]
        assert got == expected, n


def test_eagle3_chain_path_equals_the_tree_builder_at_top_k_1(target):
    """The top_k == 1 fast path must give the drafts and survivals build_dynamic_tree gives."""
    proposer = eagle3(target, draft_vocab=40, top_k=1)
    proposer.reset(1, 128)
    prompt = PROMPTS[0]
    engine = TorchTargetEngine(target, 128)
    engine.set_taps(proposer.tap_layers)
    from specrt.runtime.generate import prefill

    _, taps = prefill(engine, [prompt])
    proposer.observe([0], [prompt], [taps[0, :len(prompt)]], [3])
    chain = proposer.propose([0], [3], SamplingParams(), None)[0]
    tree = proposer._tree(0)
    assert chain.is_chain and chain.depth == 4
    assert torch.equal(chain.tokens, tree.tokens)
    assert torch.equal(tree.parents, torch.arange(-1, 3))
    assert torch.allclose(chain.survival, tree.survival)
    # a threshold cuts the chain where the survival drops below it, and nowhere else
    cut = float(tree.survival[1]) + 1e-6
    proposer.threshold = cut
    short = proposer.propose([0], [3], SamplingParams(), None)[0]
    assert len(short) == 1 and torch.equal(short.tokens, tree.tokens[:1])
    proposer.threshold = float(tree.survival[0]) + 1e-6
    assert len(proposer.propose([0], [3], SamplingParams(), None)[0]) == 0


def test_eagle3_drafts_from_the_last_ingested_row(target):
    """An ingest asks the drafter for its last row's logits only: they are the row every row's call gives
    last, in a batch of prompts of different lengths too."""
    from specrt.runtime.generate import prefill

    proposer = eagle3(target, draft_vocab=40)
    prompts = [PROMPTS[0], PROMPTS[1][:3]]
    proposer.reset(2, 128)
    engine = TorchTargetEngine(target, 128, 2)
    engine.set_taps(proposer.tap_layers)
    _, taps = prefill(engine, prompts)
    proposer.observe([0, 1], prompts, [taps[b, :len(p)] for b, p in enumerate(prompts)], [3, 4])
    for b, prompt in enumerate(prompts):
        alone = eagle3(target, draft_vocab=40)
        alone.reset(1, 128)
        calls = []
        drafter_call = alone.drafter.forward

        def every_row(*args):  # the same ingest, every row's logits
            logits, out = drafter_call(*args[:7])
            calls.append(logits)
            return logits, out

        alone.drafter.forward = every_row
        alone.observe([0], [prompt], [taps[b, :len(prompt)]], [3 + b])
        assert calls[0].shape[1] == len(prompt)
        assert torch.allclose(proposer.root_logits[b], calls[0][0, -1], atol=1e-5)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_tree_candidates_are_each_positions_top_k(target, kind):
    """A block tree's children are the top-k of their depth's distribution (DSpark: given the parent's
    token through the Markov head); the tree keeps tree_tokens - 1 nodes and no deeper than the block."""
    from specrt.runtime.generate import prefill

    proposer = block(target, kind, tree_top_k=3, tree_tokens=12)
    proposer.reset(1, 128)
    engine = TorchTargetEngine(target, 128)
    engine.set_taps(proposer.tap_layers)
    _, taps = prefill(engine, [PROMPTS[0]])
    proposer.observe([0], [PROMPTS[0]], [taps[0, :len(PROMPTS[0])]], [3])
    tree = proposer.propose([0], [3], SamplingParams(), None)[0]
    assert not tree.is_chain and len(tree) == 11 and tree.depth <= proposer.max_drafts
    depths = [0] * len(tree)
    for i, p in enumerate(tree.parents.tolist()):
        depths[i] = 1 if p < 0 else depths[p] + 1
    drafter = proposer.drafter
    start = proposer.lengths[0]
    positions = (start + torch.arange(proposer.block_size))[None]
    slots = torch.arange(start + proposer.block_size)[None, None]
    mask = slots.expand(1, proposer.block_size, -1) < start + proposer.block_size
    with torch.no_grad():
        logits, hidden = drafter(drafter.block_ids(torch.tensor([3])), positions, mask, proposer.k_cache,
                                 proposer.v_cache, positions)
    for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        if kind == "dflash":
            dist = logits[0, depths[i]]  # block index k predicts depth k
        else:
            prev = torch.tensor([3 if parent < 0 else int(tree.tokens[parent])])
            dist, _ = drafter.markov_head.step(logits[0, depths[i] - 1][None], prev, hidden[0, depths[i] - 1][None])
            dist = dist[0]
        assert token in torch.topk(dist.float(), 3).indices.tolist(), (i, depths[i])
    survival = tree.survival.tolist()
    assert all(survival[i] <= survival[p] + 1e-6 for i, p in enumerate(tree.parents.tolist()) if p >= 0)


def test_dspark_trees_need_the_markov_head(target):
    import types

    from specrt.plugins.errors import SpecrtError

    proposer = block(target, "dspark")
    exported_like = types.SimpleNamespace(kind="dspark", config=proposer.drafter.config, block_size=5, num_drafts=5,
                                          device=torch.device("cpu"))
    with pytest.raises(SpecrtError, match="--backend torch"):
        BlockProposer(exported_like, tree_top_k=2)


def test_capped_block_proposals_respect_the_cap(target):
    proposer = block(target, "dflash", max_drafts=2)
    engine = TorchTargetEngine(target, 128, 1)
    result = generate_speculative(engine, proposer, [PROMPTS[0]], 20, SamplingParams())
    assert proposer.max_drafts == 2 and len(result.stats[0].proposed_per_position) == 2


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batch3"])
def test_oracle_drafts_are_all_accepted(target, tree, batched):
    n = 30
    expected = plain(target, PROMPTS, n + 8)
    proposer = OracleProposer(expected, [len(p) for p in PROMPTS], k=4, tree=tree)
    engine = TorchTargetEngine(target, 128, len(PROMPTS))
    if batched:
        result = generate_speculative(engine, proposer, PROMPTS, n, SamplingParams())
        tokens, stats = result.tokens, result.stats
    else:
        tokens, stats = [], []
        for b, p in enumerate(PROMPTS):
            proposer_b = OracleProposer([expected[b]], [len(p)], k=4, tree=tree)
            r = generate_speculative(TorchTargetEngine(target, 128), proposer_b, [p], n, SamplingParams())
            tokens.append(r.tokens[0])
            stats.append(r.stats[0])
    assert tokens == [e[:n] for e in expected]
    for s in stats:
        assert s.rounds == -(-(n - 1) // 5)  # 4 drafts + bonus per round
        assert s.acceptance_rates()[:4] == [1.0, 1.0, 1.0, 1.0]


def test_eos_and_length_stop_inside_a_round(target):
    expected = plain(target, PROMPTS[:1], 30)[0]
    proposer = OracleProposer([expected + [0] * 10], [len(PROMPTS[0])], k=4, tree=False)
    stop = expected[9]
    r = generate_speculative(TorchTargetEngine(target, 128), proposer, PROMPTS[:1], 30, SamplingParams(), [stop])
    assert r.tokens[0] == expected[: expected.index(stop) + 1] and r.stats[0].finish_reason == "eos"
    r = generate_speculative(TorchTargetEngine(target, 128), proposer, PROMPTS[:1], 12, SamplingParams())
    assert r.tokens[0] == expected[:12] and r.stats[0].finish_reason == "length"


def test_cache_capacity_is_respected(target):
    """Near the end of the cache the proposals are cut, never written past capacity."""
    capacity = 30
    expected = plain(target, PROMPTS[:1], 40)[0]
    engine = TorchTargetEngine(target, capacity)
    r = generate_speculative(engine, block(target, "dflash"), PROMPTS[:1], 40, SamplingParams())
    assert r.stats[0].finish_reason == "cache_full"
    assert r.tokens[0] == expected[: len(r.tokens[0])]
    assert int(engine.lengths[0]) <= capacity - 1


def test_stats_split_time_and_tau(target):
    r = generate_speculative(TorchTargetEngine(target, 128), block(target, "dflash"), PROMPTS[:1], 20, SamplingParams())
    s = r.stats[0]
    assert s.rounds >= 1 and s.tau == s.round_tokens / s.rounds and 1.0 <= s.tau <= 5.0
    assert s.draft_seconds > 0 and s.verify_seconds > 0 and s.host_seconds > 0
    assert len(s.proposed_per_position) == 4


# ---------------------------------------------------------------- sampling: the distribution holds

SMALL_VOCAB = 6
SAMPLES = 6000


def exact_first_tokens(model: LlamaModel, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(first n generated tokens) by enumerating every sequence (SMALL_VOCAB ** n of them)."""
    from specrt.runtime.sampling import probabilities

    dist = {(): 1.0}
    for _ in range(n):
        seqs = list(dist)
        ids = torch.tensor([prompt + list(s) for s in seqs])
        t = ids.shape[1]
        k, v = model.new_cache(len(seqs), t)
        pos = torch.arange(t).expand(len(seqs), t)
        with torch.no_grad():
            logits, _ = model(ids, pos, torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(len(seqs), t, t), k, v, pos)
        probs = probabilities(logits[:, -1], params)
        dist = {s + (tok,): dist[s] * float(probs[i, tok]) for i, s in enumerate(seqs) for tok in range(SMALL_VOCAB)}
    return dist


def chi_square_pvalue(samples: list[list[int]], exact: dict[tuple, float], n: int) -> float:
    from scipy.stats import chisquare

    counts: dict[tuple, int] = {}
    for s in samples:
        counts[tuple(s[:n])] = counts.get(tuple(s[:n]), 0) + 1
    cells = sorted(exact, key=lambda c: -exact[c])
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for c in cells:  # pool the rare cells so every expected count is >= 5
        e = exact[c] * len(samples)
        if e >= 5:
            observed.append(counts.get(c, 0))
            expected.append(e)
        else:
            rest_o, rest_e = rest_o + counts.get(c, 0), rest_e + e
    observed.append(rest_o)
    expected.append(rest_e)
    scale = sum(observed) / sum(expected)  # float rounding of the exact probabilities
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def sampled(target, proposer, prompt, params, n, seeded_sampling="stream"):
    """SAMPLES independent generations at once: one batch row each. The seed makes the run
    reproducible; "stream" keeps it on rejection sampling (verify.py), "noise" on the seeded rule."""
    engine = TorchTargetEngine(target, 32, SAMPLES)
    if proposer is None:
        return generate_autoregressive(engine, [prompt] * SAMPLES, n, params, seeded_sampling=seeded_sampling).tokens
    return generate_speculative(engine, proposer, [prompt] * SAMPLES, n, params,
                                seeded_sampling=seeded_sampling).tokens


@pytest.fixture(scope="module")
def small_target():
    model = tiny_target(vocab=SMALL_VOCAB, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # back to spread-out distributions: sampling must matter
    return model


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark", "dflash-tree", "dspark-tree"])
def test_sampling_matches_the_target_distribution(small_target, kind):
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 2]
    if kind == "eagle3":
        proposer = eagle3(small_target)
    elif kind.endswith("-tree"):
        proposer = block(small_target, kind.removesuffix("-tree"), tree_top_k=2, tree_tokens=6)
    else:
        proposer = block(small_target, kind, threshold=0.05)
    exact = exact_first_tokens(small_target, prompt, params, 3)
    assert chi_square_pvalue(sampled(small_target, proposer, prompt, params, 3), exact, 3) > 1e-3


def test_one_seed_gives_each_batch_row_its_own_exact_sample(small_target):
    """A batch with one seed: row b follows the seeded rule with `row_seed(seed, b)` (greedy drafts,
    verified on Gumbel-perturbed scores), so SAMPLES rows of one prompt are independent exact samples."""
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 2]
    got = sampled(small_target, block(small_target, "dflash", threshold=0.05), prompt, params, 3, seeded_sampling="noise")
    assert chi_square_pvalue(got, exact_first_tokens(small_target, prompt, params, 3), 3) > 1e-3


def test_sampling_test_catches_a_wrong_acceptance_rule(small_target, monkeypatch):
    """The same test fails when drafts are accepted without the ratio test."""
    import specrt.runtime.step as loop

    def accept_everything(tokens, draft_probs, target_probs, generator=None):
        k = int(tokens.shape[0])
        return k, int(torch.multinomial(target_probs[k].float(), 1, generator=generator))

    monkeypatch.setattr(loop, "verify_chain_sampling", accept_everything)
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 2]
    exact = exact_first_tokens(small_target, prompt, params, 3)
    pvalue = chi_square_pvalue(sampled(small_target, block(small_target, "dflash"), prompt, params, 3), exact, 3)
    assert pvalue < 1e-6


def test_tree_sampling_test_catches_a_wrong_acceptance_rule(small_target, monkeypatch):
    """Trees too: taking the first child without the acceptance test breaks the distribution."""
    import specrt.runtime.step as loop

    def first_child_always(tokens, parents, target_probs, child_draft_probs, generator=None):
        path, node = [], -1
        while True:
            children = [i for i, p in enumerate(parents.tolist()) if p == node]
            if not children:
                return path, int(torch.multinomial(target_probs[node + 1].float(), 1, generator=generator))
            node = children[0]
            path.append(node)

    monkeypatch.setattr(loop, "verify_tree_sampling", first_child_always)
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 2]
    exact = exact_first_tokens(small_target, prompt, params, 3)
    assert chi_square_pvalue(sampled(small_target, eagle3(small_target), prompt, params, 3), exact, 3) < 1e-6
