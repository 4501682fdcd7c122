"""Train an EAGLE-3 drafter for a target on the regenerated data set (training-time test).

    python -m specrt.tools.train_eagle3 --data tools/data/sharegpt-smollm2 --out runs/eagle3
        [--draft-vocab-size 8192] [--intermediate-size 1536] [--ttt-steps 7] [--epochs 1.5]
        [--batch-size 4] [--lr 5e-4] [--max-minutes 110] [--threads 1] [--resume [--remap-vocab]]
        [--init-from DRAFTER_FOLDER]

Objective (reference: SafeAILab/EAGLE `eagle/traineagle3/cnets.py`, arXiv 2503.01840):
- Draft vocabulary: the `draft_vocab_size` most frequent target tokens of the training responses
  (ties: lower id first), sorted by id; `d2t[i] = used[i] - i`, `t2d[t] = t in used` (DESIGN.md 3).
- Row j of a sequence pairs the fused target feature of token j (fc over hidden_states[2, L//2,
  L-3]) with the embedding of token j+1, sits at position j and predicts token j+2.
- Training-time test, `--ttt-steps` 7 unrolled steps. Step 0 runs every row on the target's fused
  features. Step i feeds row j the drafter's own output of step i-1 for that row, with the token
  one further (j+1+i) and the position j+i: exactly a chain node at depth i in the runtime's tree.
  Attention (the reference's extended mask): row j at step i attends the step-0 keys of rows
  0..j (causal) and its own keys of steps 1..i (the "diagonal" of the extended mask); it is
  computed without a [T, 7T] score matrix: the step-0 scores are one T x T product and every later
  step adds one score per row (`ttt_attention`).
- Loss: sum_i 0.8^i * KL(p_target || p_draft) over the draft vocabulary, where p_target is the
  target's softmax restricted to the draft tokens (t2d) and renormalised (as the reference; the
  target logits are `lm_head(norm(h_L))` of the cached last hidden state, computed for the draft
  rows only). A position counts when the token it predicts is a response token (not the prompt)
  and that token is in the draft vocabulary (the reference's t2d[target argmax] mask; the data
  are the target's greedy outputs, so the next data token is the target's argmax). Each step's KL
  is averaged over its supervised positions (the reference divides by all positions).
- Rows that can never be supervised (prompt rows more than `ttt_steps` before the response) only
  provide step-0 keys: their queries, MLP and heads are skipped.
- Initialisation: fc and midlayer random; `lm_head` starts from the target's LM-head rows of the
  draft tokens and `norm` from the target's final norm (`--no-head-init` for the reference's
  random head); the embedding is the target's (frozen, not saved). `--init-from FOLDER` starts
  instead from a saved EAGLE-3 drafter of the same shape (e.g. the shipped one, to continue training
  when its training state is gone, or to adapt it to your own data): every weight is loaded, the
  head is moved onto this run's draft vocabulary like `--remap-vocab` does, and the optimizer and
  LR schedule start fresh.
- Validation: KL per step and accuracy per step (argmax over the draft vocabulary equals the
  target's restricted argmax) on the held-out 5 %.

CPU defaults (each drafter must train well under 2 hours on this 2-core machine). Measured at the
SmolLM2-135M dims, batch of 4 sequences of 300 tokens (100 prompt + 200 response), while the data
builder kept both cores busy, torch on 1 thread: 4.2 s per step at draft vocabulary 8192 and
intermediate 1536 (3.8 s at intermediate 768; 2 threads against the busy cores: 10-15 s). Per
supervised row and TTT step the draft LM head is about half of the FLOPs at 8192 rows (9.4 of 17.6
MFLOP forward; the midlayer's MLP 5.3), so the vocabulary is the lever: 8192 rows are a sixth of the
full 49152-row head, in training and in every tree expansion at inference, and covered every
response token of the first 768 built samples (6575 distinct tokens; 4096 would have covered 97.7 %,
2048 91.6 %; the trainer prints the coverage of the full training split at start). The intermediate
size stays the target's 1536 (halving it saves only ~10 %). 1.5 epochs over the ~2850 training
samples, batch 4 (~1070 steps), lr 5e-4 (warmup 3 %, cosine to 10 %): about 75 min in the conditions
above, less on an idle machine; the held-out check runs every 250 steps on 48 samples. `--max-
minutes` (default 110) anneals the schedule on time if a slower machine would run over. On a machine
shared with another job, `--threads 1` is several times faster than torch's default.

Precision: `--precision auto` trains the forward in bf16 on a CPU with native bf16 (train_common):
`python -m specrt.tools.bench_train_step --kind eagle3` measured 7.08 -> 2.24 s per step (3.16x) on
this machine, 1 thread, the other core busy, same first-step loss to 4e-4 relative.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from specrt.plugins.errors import SpecrtError
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.export.models.layers import gather_rows
from specrt.tools.train_common import full_precision

DEFAULT_DRAFT_VOCAB = 8192
TTT_STEPS = 7
STEP_DECAY = 0.8


# -- draft vocabulary ----------------------------------------------------------------------------
@dataclass
class DraftVocab:
    tokens: torch.Tensor  # [Vd] target ids, ascending
    d2t: torch.Tensor  # [Vd] int64, target = draft + d2t[draft]
    t2d: torch.Tensor  # [V] bool
    coverage: float  # share of the counted tokens that are in the draft vocabulary
    counted: int


def build_draft_vocab(responses: Iterable[Sequence[int]], draft_vocab_size: int, vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent tokens of `responses` (ties: lower id first).

    When the data hold fewer distinct tokens, the rest is filled with the lowest unused ids so the
    vocabulary has exactly `draft_vocab_size` entries (the checkpoint's shapes are fixed).
    """
    if not 1 <= draft_vocab_size <= vocab_size:
        raise SpecrtError(f"draft vocabulary size {draft_vocab_size} is outside 1..{vocab_size}",
                          "pass --draft-vocab-size between 1 and the target's vocabulary size")
    counts: Counter[int] = Counter()
    for seq in responses:
        counts.update(int(t) for t in seq)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:draft_vocab_size]]
    total = sum(counts.values())
    covered = sum(counts[t] for t in chosen)
    if len(chosen) < draft_vocab_size:
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][: draft_vocab_size - len(chosen)]
    return vocab_from_tokens(torch.tensor(sorted(chosen), dtype=torch.long), vocab_size, covered / max(total, 1), total)


def vocab_from_tokens(tokens: torch.Tensor, vocab_size: int, coverage: float, counted: int) -> DraftVocab:
    tokens = tokens.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[tokens] = True
    return DraftVocab(tokens, tokens - torch.arange(len(tokens)), t2d, coverage, counted)


def kept_draft_vocab(tokens: Sequence[int], responses: Iterable[Sequence[int]], vocab_size: int) -> DraftVocab:
    """A resumed run's vocabulary (the checkpoint's rows are tied to it), with its coverage of `responses`.

    A data set that grew since the run started would rank other tokens first; rebuilding the vocabulary
    would silently re-map the trained head's rows, so the run keeps the one it started with."""
    keep = torch.as_tensor(list(tokens), dtype=torch.long)
    member = torch.zeros(vocab_size, dtype=torch.bool)
    member[keep] = True
    counted = covered = 0
    for seq in responses:
        ids = torch.as_tensor(list(seq), dtype=torch.long)
        counted += len(ids)
        covered += int(member[ids].sum())
    return vocab_from_tokens(keep, vocab_size, covered / max(counted, 1), counted)


def head_space_map(target_rows: torch.Tensor, trained_rows: torch.Tensor, ridge: float = 1e-3):
    """The affine map x -> [x, 1] @ A fitted by ridge least squares so target_rows map to trained_rows
    (ridge relative to the mean squared feature, so the fit does not depend on the rows' scale)."""
    x = torch.cat([target_rows.double(), torch.ones(len(target_rows), 1, dtype=torch.float64)], 1)
    gram = x.T @ x
    lam = ridge * float(gram.diagonal().mean())
    a = torch.linalg.solve(gram + lam * torch.eye(x.shape[1], dtype=torch.float64), x.T @ trained_rows.double())

    def apply(rows: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(len(rows), 1, dtype=torch.float64)
        return (torch.cat([rows.double(), ones], 1) @ a).to(trained_rows.dtype)
    return apply


def remap_head_rows(state: dict, slots: Sequence[str], old_tokens: Sequence[int], vocab: DraftVocab,
                    target_head: torch.Tensor) -> tuple[int, int]:
    """Move a saved training state (model + AdamW moments) onto another draft vocabulary, in place.

    Row j of the new head is the trained row of the same target token where the old vocabulary had
    it (its Adam moments carried with it). A token new to the vocabulary gets its target LM-head row
    carried into the trained head's space by the affine map that best takes the old tokens' target
    rows to their trained rows (ridge least squares), with zero moments. Why the map: a trained head
    drifts from the target's as a whole. Measured on the shipped SmolLM2 drafter (step 3883, 1828 of
    8192 rows new): raw target rows scored +6 on average against -6 for trained rows, won every
    argmax and raised the step-1 KL on a training batch from 0.36 to 16.5; a mean shift alone left
    2.2; the map (residual 12 % of the trained rows' norm) gives 0.36. `slots` are the optimizer's
    parameter names in state-index order (train_common.optimizer_slots). Returns (rows kept, rows new)."""
    old = torch.as_tensor(list(old_tokens), dtype=torch.long)
    row_of = torch.full((target_head.shape[0],), -1, dtype=torch.long)
    row_of[old] = torch.arange(len(old))
    src = row_of[vocab.tokens]
    kept = src >= 0

    def moved(rows: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        out = fresh.to(rows.dtype).clone()
        out[kept] = rows[src[kept]]
        return out

    model = state["model"]
    weight = model["lm_head.weight"]
    if weight.shape[0] != len(old):
        raise SpecrtError(f"the saved head has {weight.shape[0]} rows but its vocabulary {len(old)} tokens",
                          "the training state is inconsistent; start a new --out")
    model["lm_head.weight"] = moved(weight, head_space_map(target_head[old], weight)(target_head[vocab.tokens]))
    model["d2t"] = vocab.d2t.clone()
    model["t2d"] = vocab.t2d.clone()
    moments = state["optimizer"]["state"].get(list(slots).index("lm_head.weight"), {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in moments:
            moments[key] = moved(moments[key], torch.zeros_like(weight))
    state.setdefault("extra", {})["draft_vocab_tokens"] = vocab.tokens.tolist()
    return int(kept.sum()), int((~kept).sum())


# -- training-time test ----------------------------------------------------------------------------
def ttt_attention(q, k0, v0, mask0, diag_k: list, diag_v: list) -> torch.Tensor:
    """Attention of R query rows over step-0 keys (mask0 [B, R, T]) plus one own key per later step.

    q [B, Hq, R, D]; k0/v0 [B, Hkv, T, D]; diag_k/diag_v: lists of [B, Hkv, R, D] (row r's own K/V of
    steps 1..i). Returns [B, Hq, R, D]; equals masked attention over [K0 ; K1 ; ... ; Ki] with the
    extended mask [mask0, eye, ..., eye].
    """
    hq, hkv = q.shape[1], k0.shape[1]
    group = hq // hkv
    scale = q.shape[-1] ** -0.5

    def heads(x):
        return x.repeat_interleave(group, dim=1) if group > 1 else x

    scores = torch.matmul(q, heads(k0).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask0[:, None], float("-inf"))
    extra = [(q * heads(k)).sum(-1, keepdim=True) * scale for k in diag_k]
    probs = torch.softmax(torch.cat([scores] + extra, dim=-1), dim=-1)
    t = k0.shape[2]
    out = torch.matmul(probs[..., :t], heads(v0))
    for s, v in enumerate(diag_v):
        out = out + probs[..., t + s:t + s + 1] * heads(v)
    return out


def ttt_rows(prompt_lengths: torch.Tensor, lengths: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First row and row count per sample of the rows that some step supervises.

    Row j predicts token j+2+i at step i; supervised tokens are the response tokens P..N-1, so the
    rows are max(0, P-1-steps) .. N-3.
    """
    start = (prompt_lengths - 1 - steps).clamp(min=0)
    count = (lengths - 2 - start).clamp(min=0)
    return start, count


def ttt_forward(drafter: Eagle3Drafter, fused: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                start: torch.Tensor, num_rows: int, steps: int) -> list[torch.Tensor]:
    """The unrolled drafter: outputs [B, R, H] per step for rows start_b .. start_b + R - 1.

    fused [B, T, H] = fc(taps) of rows 0..T-1 (T = N - 1), tokens [B, N], lengths [B] (N_b).
    """
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    b, t, _ = fused.shape
    n = tokens.shape[1]
    device = fused.device
    rows_all = torch.arange(t, device=device)
    valid_keys = rows_all[None, :] < (lengths - 1)[:, None]  # row j exists when token j+1 does
    emb0 = drafter.embed(tokens[:, 1:t + 1]).to(fused.dtype)
    x0 = torch.cat([layer.input_layernorm(emb0), layer.hidden_norm(fused)], dim=-1)
    cos0, sin0 = drafter.rotary(rows_all.expand(b, t))
    k0, v0 = attn.project_kv(x0, cos0, sin0)
    sel = (start[:, None] + torch.arange(num_rows, device=device)[None, :]).clamp(max=t - 1)  # [B, R]
    mask0 = (rows_all[None, None, :] <= sel[:, :, None]) & valid_keys[:, None, :]
    hidden = gather_rows(fused, sel)
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    outs = []
    for i in range(steps):
        ids = torch.gather(tokens, 1, (sel + 1 + i).clamp(max=n - 1))
        x = torch.cat([layer.input_layernorm(drafter.embed(ids).to(hidden.dtype)), layer.hidden_norm(hidden)], dim=-1)
        cos, sin = drafter.rotary(sel + i)
        q = attn.project_q(x, cos, sin)
        if i > 0:
            k, v = attn.project_kv(x, cos, sin)
            diag_k.append(k)
            diag_v.append(v)
        o = ttt_attention(q, k0, v0, mask0, diag_k, diag_v)
        h1 = hidden + attn.o_proj(o.transpose(1, 2).reshape(b, num_rows, -1))
        out = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        outs.append(out)
        hidden = out
    return outs


class Eagle3Objective:
    """Loss and validation metrics of EAGLE-3 on cached features."""

    def __init__(self, store, target, drafter: Eagle3Drafter, steps: int = TTT_STEPS, decay: float = STEP_DECAY):
        self.store, self.steps, self.decay = store, int(steps), float(decay)
        self.taps = list(drafter.config.tap_layers)
        self.target_norm = target.norm
        # the target's LM head restricted to the draft vocabulary: target logits over t2d
        vocab = drafter.d2t + torch.arange(drafter.config.draft_vocab_size)
        self.head = target.lm_head.weight.detach()[vocab].float()
        self.t2d = drafter.t2d.clone()

    def _batch_terms(self, drafter: Eagle3Drafter, indices: Sequence[int], metrics: bool = False):
        """Per TTT step: (KL per supervised row, correct per row or None), or None without rows."""
        fb = self.store.batch(indices, self.taps, with_last=True)
        tokens, lengths, prompts = fb.tokens, fb.lengths, fb.prompt_lengths
        n = tokens.shape[1]
        t = n - 1
        start, count = ttt_rows(prompts, lengths, self.steps)
        r = max(int(count.max()), 1)
        fused = drafter.fuse(fb.taps[:, :t])
        outs = ttt_forward(drafter, fused, tokens, lengths, start, r, self.steps)
        row = torch.arange(r)[None, :]
        sel = start[:, None] + row
        # target distributions on the window of positions start+1 .. start+r+steps-1 (shared by all steps)
        win = (start[:, None] + 1 + torch.arange(r + self.steps - 1)[None, :]).clamp(max=n - 1)
        with torch.no_grad(), full_precision():  # the labels stay fp32 under a bf16 training forward
            h_last = gather_rows(fb.last, win)
            logp_win = torch.log_softmax(self.target_norm(h_last).float() @ self.head.T, dim=-1)
            p_win = logp_win.exp()
            entropy_win = -(p_win * logp_win).sum(-1)
            argmax_win = logp_win.argmax(-1) if metrics else None
            del logp_win
        terms = []
        for i, out in enumerate(outs):
            y = sel + 2 + i  # the token this step predicts
            next_tok = torch.gather(tokens, 1, y.clamp(max=n - 1))
            mask = (row < count[:, None]) & (y >= prompts[:, None]) & (y <= lengths[:, None] - 1) & self.t2d[next_tok]
            if not bool(mask.any()):
                terms.append(None)
                continue
            logits = drafter.lm_head(drafter.norm(out[mask])).float()
            # KL(p || q) = CE(p, q) - H(p); the soft-target cross entropy is one fused kernel
            kl = F.cross_entropy(logits, p_win[:, i:i + r][mask], reduction="none") - entropy_win[:, i:i + r][mask]
            correct = None
            if metrics:
                correct = (logits.detach().argmax(-1) == argmax_win[:, i:i + r][mask]).float()
            terms.append((kl, correct))
        return terms

    def loss(self, drafter: Eagle3Drafter, indices: list[int], generator: torch.Generator):
        terms = self._batch_terms(drafter, indices)
        loss = torch.zeros(())
        positions = 0
        for i, term in enumerate(terms):
            if term is None:
                continue
            loss = loss + (self.decay ** i) * term[0].mean()
            positions += int(term[0].numel())
        if positions == 0:  # nothing supervised in this batch: a zero loss that still has a graph
            loss = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0
        return loss, {"positions": positions}

    def evaluate(self, drafter: Eagle3Drafter, indices: Sequence[int], batch_size: int = 4) -> dict:
        kl_sum = np.zeros(self.steps)
        acc_sum = np.zeros(self.steps)
        count = np.zeros(self.steps)
        for s in range(0, len(indices), batch_size):
            for i, term in enumerate(self._batch_terms(drafter, list(indices[s:s + batch_size]), metrics=True)):
                if term is None:
                    continue
                kl_sum[i] += float(term[0].sum())
                acc_sum[i] += float(term[1].sum())
                count[i] += term[0].numel()
        kl = kl_sum / np.maximum(count, 1)
        acc = acc_sum / np.maximum(count, 1)
        loss = float(sum((self.decay ** i) * kl[i] for i in range(self.steps)))
        return {"loss": loss, "kl": [float(x) for x in kl], "acc": [float(x) for x in acc]}


# -- CLI -------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from specrt.tools.train_common import add_common_args

    ap = argparse.ArgumentParser(prog="python -m specrt.tools.train_eagle3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("EAGLE-3")
    g.add_argument("--draft-vocab-size", type=int, default=DEFAULT_DRAFT_VOCAB)
    g.add_argument("--intermediate-size", type=int, default=None, help="midlayer MLP width (default: the target's)")
    g.add_argument("--ttt-steps", type=int, default=TTT_STEPS, help="unrolled training-time-test steps")
    g.add_argument("--step-decay", type=float, default=STEP_DECAY, help="loss weight of step i is decay**i")
    g.add_argument("--no-head-init", action="store_true", help="random lm_head/norm instead of the target's rows")
    g.add_argument("--remap-vocab", action="store_true",
                   help="with --resume: rebuild the draft vocabulary from the current data (the set grew) and "
                   "carry the trained head rows of the tokens it keeps; new tokens start from their target rows "
                   "mapped into the trained head's space")
    g.add_argument("--init-from", type=Path, default=None, metavar="DRAFTER_FOLDER",
                   help="start from this EAGLE-3 drafter's weights (official format, e.g. the shipped one) "
                   "instead of random layers; ignored when --resume finds a training state")
    add_common_args(ap, lr=5e-4, batch_size=4, epochs=1.5)
    return ap.parse_args(argv)


def build_drafter(args: argparse.Namespace, target, store,
                  kept_tokens: Sequence[int] | None = None) -> tuple[Eagle3Drafter, DraftVocab]:
    cfg = target.config
    responses = (store.response(i) for i in store.train_indices)
    if kept_tokens is not None:
        if len(kept_tokens) != args.draft_vocab_size:
            raise SpecrtError(f"--resume: the run's draft vocabulary has {len(kept_tokens)} tokens, "
                              f"--draft-vocab-size asks for {args.draft_vocab_size}",
                              f"resume with --draft-vocab-size {len(kept_tokens)}, or start a new --out")
        vocab = kept_draft_vocab(kept_tokens, responses, cfg.vocab_size)
    else:
        vocab = build_draft_vocab(responses, args.draft_vocab_size, cfg.vocab_size)
    torch.manual_seed(args.seed)
    dcfg = Eagle3Config.for_target(cfg, args.draft_vocab_size, intermediate_size=args.intermediate_size)
    drafter = Eagle3Drafter(dcfg)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    if not args.no_head_init:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(target.lm_head.weight[vocab.tokens])
            drafter.norm.weight.copy_(target.norm.weight)
    drafter.bind_target_embedding(target.embed_tokens)
    return drafter, vocab


def resumed_draft_vocab(args: argparse.Namespace) -> list[int] | None:
    """The draft vocabulary a --resume run started with (None: a fresh run, or a state without one)."""
    from specrt.tools.train_common import STATE_FILE, load_state

    path = Path(args.out) / STATE_FILE
    if not (args.resume and path.exists()):
        return None
    tokens = (load_state(path).get("extra") or {}).get("draft_vocab_tokens")
    return None if tokens is None else [int(t) for t in tokens]


def remap_resumed_vocab(args: argparse.Namespace, target, store, old_tokens: Sequence[int]) -> list[int]:
    """--remap-vocab: rewrite <out>/train_state.pt onto the vocabulary the data ranks now (the old state
    is kept as train_state.pre_remap.pt); returns the new vocabulary's tokens."""
    from specrt.tools.train_common import STATE_FILE, load_state, optimizer_slots

    responses = [store.response(i) for i in store.train_indices]
    vocab = build_draft_vocab(responses, len(old_tokens), target.config.vocab_size)
    before = kept_draft_vocab(old_tokens, responses, target.config.vocab_size).coverage
    if vocab.tokens.tolist() == list(old_tokens):
        print("--remap-vocab: the data ranks the same draft vocabulary; nothing to re-map", file=sys.stderr)
        return list(old_tokens)
    path = Path(args.out) / STATE_FILE
    state = load_state(path)
    slots = optimizer_slots(build_drafter(args, target, store, old_tokens)[0])
    kept, new = remap_head_rows(state, slots, old_tokens, vocab, target.lm_head.weight.detach())
    path.replace(path.with_name("train_state.pre_remap.pt"))
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    print(f"--remap-vocab: {kept} head rows kept, {new} new (target rows mapped into the trained head); coverage of the "
          f"training responses {before:.2%} -> {vocab.coverage:.2%}", file=sys.stderr)
    return vocab.tokens.tolist()


def init_from_drafter(drafter: Eagle3Drafter, vocab: DraftVocab, folder: Path, target) -> tuple[int, int]:
    """Load a saved EAGLE-3 drafter's weights into `drafter` (built on this run's vocabulary `vocab`),
    its head re-mapped as `remap_head_rows` does (no optimizer moments to carry). Returns (head rows
    kept, head rows new). A drafter of another shape is refused with the flag that would fit it."""
    from specrt.export.checkpoints.drafters import load_drafter
    from specrt.tools.train_common import optimizer_slots

    start = load_drafter(folder, target.config, kind="eagle3")
    if start.config.norm_before_residual:
        # the training step computes the plain residual: fine-tuning would silently change the variant
        raise SpecrtError(f"--init-from {folder}: a norm_before_residual EAGLE-3 (speculators variant), which "
                          "this trainer does not compute", "start from a SafeAILab-style EAGLE-3 drafter, or none")
    model = {k: v.float() for k, v in start.state_dict().items()}
    old_tokens = (start.d2t + torch.arange(len(start.d2t))).tolist()
    if start.config.intermediate_size != drafter.config.intermediate_size:
        raise SpecrtError(f"--init-from {folder}: its midlayer MLP is {start.config.intermediate_size} wide, "
                          f"this run builds {drafter.config.intermediate_size}",
                          f"pass --intermediate-size {start.config.intermediate_size}")
    state = {"model": model, "optimizer": {"state": {}}}
    kept, new = remap_head_rows(state, optimizer_slots(drafter), old_tokens, vocab, target.lm_head.weight.detach())
    own = drafter.state_dict()
    wrong = [k for k in own if k in model and tuple(model[k].shape) != tuple(own[k].shape)]
    if wrong:
        raise SpecrtError(f"--init-from {folder}: tensor {wrong[0]} has shape {tuple(model[wrong[0]].shape)}, "
                          f"this run's drafter {tuple(own[wrong[0]].shape)}",
                          "start from a drafter trained for the same target with the same EAGLE-3 options")
    drafter.load_state_dict({k: model[k] for k in own if k in model}, strict=False)
    return kept, new


def prepare(args: argparse.Namespace, target):
    """The drafter (resumed vocabulary, --remap-vocab, --init-from applied), its feature store, objective
    and batch plan, exactly as a run trains them (shared by `run` and `specrt.tools.bench_train_step`)."""
    from types import SimpleNamespace

    from specrt.tools.train_common import BatchPlan, all_drafter_taps, feature_store, frozen_target

    target = frozen_target(target)
    taps = sorted(set(all_drafter_taps(target.config.num_layers)))
    store = feature_store(args, target, taps)
    kept_tokens = resumed_draft_vocab(args)
    if args.remap_vocab:
        if kept_tokens is None:
            raise SpecrtError("--remap-vocab re-maps a resumed run's draft vocabulary, but there is none to resume",
                              "pass --resume with an --out that holds a train_state.pt, or drop --remap-vocab")
        kept_tokens = remap_resumed_vocab(args, target, store, kept_tokens)
    drafter, vocab = build_drafter(args, target, store, kept_tokens)
    if args.init_from is not None:
        if kept_tokens is not None:
            print(f"--init-from ignored: --resume continues {Path(args.out) / 'train_state.pt'}", file=sys.stderr)
        else:
            kept, new = init_from_drafter(drafter, vocab, args.init_from, target)
            print(f"--init-from {args.init_from}: weights loaded; head rows {kept} kept, {new} new "
                  f"(target rows mapped into its head)", file=sys.stderr)
    print(f"draft vocabulary: {len(vocab.tokens)} tokens cover {vocab.coverage:.2%} of {vocab.counted} "
          f"training response tokens", file=sys.stderr)
    objective = Eagle3Objective(store, target, drafter, args.ttt_steps, args.step_decay)
    plan = BatchPlan(store.train_indices, store.lengths, args.batch_size, args.seed)
    return SimpleNamespace(target=target, drafter=drafter, vocab=vocab, store=store, objective=objective, plan=plan)


def run(args: argparse.Namespace, target) -> dict:
    """Train with an already loaded target model (the CLI loads it; tests pass a tiny one)."""
    from specrt.tools.train_common import (
        LoopConfig,
        save_final,
        steps_for,
        train_loop,
        validation_indices,
        write_summary,
    )

    prep = prepare(args, target)
    drafter, vocab, store, objective, plan = prep.drafter, prep.vocab, prep.store, prep.objective, prep.plan
    steps = steps_for(args, plan)
    val = validation_indices(store, args.val_samples)
    result = train_loop(
        drafter, objective.loss, lambda m: objective.evaluate(m, val), plan,
        LoopConfig.from_args(args, steps, "eagle3"),
        extra_state={"draft_vocab_tokens": vocab.tokens, "args": vars(args)},
    )
    folder = save_final(drafter, args.out)
    summary = {
        "kind": "eagle3", "drafter": str(folder), "steps": result.step, "finished": result.finished,
        "seconds": round(result.seconds, 1), "draft_vocab_size": args.draft_vocab_size,
        "draft_vocab_coverage": vocab.coverage, "train_samples": len(store.train_indices),
        "val_samples": len(val), "validation": result.last_eval, "args": vars(args),
    }
    write_summary(args.out, summary)
    if result.last_eval:
        print("validation accuracy per TTT step: " + " ".join(f"{a:.3f}" for a in result.last_eval["acc"]),
              file=sys.stderr)
    return {"drafter": drafter, "result": result, "summary": summary, "store": store}


def main(argv: Sequence[str] | None = None) -> int:
    from specrt.tools.train_common import load_target_model

    args = parse_args(argv)
    run(args, load_target_model(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
