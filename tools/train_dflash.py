"""Train a DFlash or DSpark drafter (shared backbone code; `--kind` picks the objective).

    python -m specrt.tools.train_dflash --kind dflash --data tools/data/sharegpt-smollm2 --out runs/dflash
    python -m specrt.tools.train_dflash --kind dspark --data tools/data/sharegpt-smollm2 --out runs/dspark
        [--num-layers 1] [--block-size 16|7] [--blocks-per-seq 8|16] [--markov-rank 64]
        [--markov-variant vanilla] [--epochs 4|3] [--batch-size 4] [--lr 6e-4] [--max-minutes 110]
        [--threads 1] [--resume] [--init-from DRAFTER_FOLDER]

Backbone (DESIGN.md section 3; z-lab/dflash, deepseek-ai/DeepSpec): the fused taps H_ctx =
hidden_norm(fc(taps)) of every position of a sequence enter each layer as keys/values, computed
once per sequence; blocks [anchor, MASK x (Bk-1)] at positions a .. a+Bk-1 query them.

Packing: `--blocks-per-seq` random anchors per sequence are drawn without replacement from the
response positions a with a+1 still in the sequence (the first anchor at inference is the first
generated token, so prompt positions are never anchors); a new draw every step (a pure function of
seed and step). All blocks of a sequence run in one forward: the queries are the nb*Bk block
tokens, the keys [context K/V of the T positions ; the nb*Bk block K/V], and the mask
(`block_attention_mask`) lets block n see the context slots < a_n and its own Bk slots (non-
causally), nothing else, which is what one block sees at inference. The forward is the
drafter's own inference code (`ingest_context` + `backbone` on explicit per-layer caches), so
training and drafting cannot drift apart. The target's embedding and LM head are shared and frozen;
K/V width (`--num-kv-heads`, default the target's): the context reaches a block only through the
layers' keys/values, and in the first layer the MASK queries carry no content, so num_kv_heads *
head_dim bounds what a draft can read of each context position (SmolLM2: 3 x 64 of 576 dims).
A multiple of the target's heads starts as repeated copies of them (`repeat_kv_heads`: the same
function as GQA at step 0, from the target's layer or from an --init-from drafter).
the drafter layers start from the target's last `--num-layers` layers (`init_from_target`), or,
with `--init-from FOLDER`, from a trained drafter of the same kind: its shape and weights, a fresh
optimizer and schedule (to train a shipped drafter on more or other data).

DFlash objective: block index k predicts the token at a+k (k >= 1, Bk-1 drafts); cross entropy
against the data token (the target's greedy output) weighted exp(-(k-1)/gamma). The paper uses
gamma = 7 for Bk = 16; for other block sizes gamma scales with the block, gamma = 7 * Bk / 16
(the weight of the last draft stays about exp(-2)), `--loss-gamma` overrides it.

DSpark objective (DeepSpec `compute_dspark_loss`): gamma = Bk inputs, index k predicts a+k+1
(label shift +1, Bk drafts). Logits l_k = lm_head(h_k) + Markov bias of the previous token,
teacher-forced (`markov_block_logits` with prev = [anchor, labels...]). Per position d = k+1:
    0.1 * CE(l_k, label) + 0.9 * TV(p_d, p_t) + 1.0 * BCE(sigmoid(z_k), 1 - TV(p_d, p_t) detached)
with TV = 0.5 * |p_d - p_t|_1 (DeepSpec's code applies its 0.9 to the L1 norm, i.e. 2 * TV; we
follow the written objective), p_t = softmax of the target logits lm_head(norm(h_L)) at the label's
previous position, z_k = the confidence head on [h_k ; W1[prev]]; every term weighted
exp(-(d-1)/gamma_w), gamma_w = 4 for Bk = 7 (scaled 4 * Bk / 7 otherwise) and averaged over valid
positions. After training, STS calibration (`specrt.tools.calibrate_sts`) fits the survival
temperatures on the held-out split and stores them with the checkpoint.

Validation (held-out 5 %, fixed anchors): loss, accuracy per draft position and the greedy
acceptance length it implies, tau_est = 1 + E[leading correct drafts] (for DSpark the teacher-
forced Markov chain equals the greedy chain as long as all previous drafts were right, so this is
the tau of verifying the whole block).

CPU defaults (each run well under 2 hours on this 2-core machine): one drafter layer (the papers'
drafters have 1-5; one layer started from the target's last layer learns fastest here), the
target's dims (needed to start from its layer), 5 taps (z-lab's spread), batch 4 sequences, lr 6e-4
(DeepSpec's), warmup 3 %, cosine to 10 %, `--max-minutes 110` as the guard (the schedule anneals on
time if a slower machine would run over). The step cost is dominated by the 49152-wide target LM
head on every supervised block position (and, for DSpark, the target's own distribution and the
Markov head there), so the positions per sequence set the time: DFlash 8 blocks of 16, DSpark 16
blocks of 7 (~120 positions per sequence, about one response), anchors redrawn every step.
Measured at the SmolLM2 dims, 4 sequences of 300 tokens, 1 torch thread while the data builder
kept both cores busy: DFlash 1.0 s per step -> 4 epochs (~2850 steps) ~47 min; DSpark (rank 64)
1.9 s per step -> 3 epochs (~2140 steps) ~68 min. Markov rank 64 (the paper's 256 is for GPUs):
the sequential Markov chain reads W2 (r x 49152) once per draft, memory-bound on a CPU; one
drafting round (backbone + 7 Markov steps, batch 1, 1 thread) took 37 ms at rank 64 and 115 ms at
rank 256, a training step 4.1 s against 5.0 s (2 threads, same load). On a machine shared with
another job, `--threads 1` is several times faster than torch's default.
bf16 (`--precision auto` on this CPU) made a DSpark step 1.53x faster (2.68 -> 1.76 s, 1 thread, K/V
heads grown to 9; `python -m specrt.tools.bench_train_step --kind dspark`): the 49k-wide softmaxes
and the fp32 labels are not matmuls, so bf16 gains less here than for EAGLE-3.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from specrt.plugins.errors import SpecrtError
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import MARKOV_VARIANTS, DSparkConfig, DSparkDrafter
from specrt.tools.dflash_blocks import block_labels, packed_block_hidden, position_weights, sample_anchors
from specrt.tools.train_common import full_precision

DEFAULTS = {
    "dflash": dict(block_size=16, blocks_per_seq=8, epochs=4.0),
    "dspark": dict(block_size=7, blocks_per_seq=16, epochs=3.0),
}
DEFAULT_MARKOV_RANK = 64


def default_loss_gamma(kind: str, block_size: int) -> float:
    """Position-weight decay length: DFlash 7 at Bk=16, DSpark 4 at Bk=7, scaled with the block size."""
    return 7.0 * block_size / 16.0 if kind == "dflash" else 4.0 * block_size / 7.0


class BlockObjective:
    """DFlash weighted CE or DSpark CE + TV + confidence BCE on cached features."""

    def __init__(self, store, target, drafter: DFlashDrafter, blocks_per_seq: int, gamma: float,
                 ce_weight: float = 0.1, tv_weight: float = 0.9, conf_weight: float = 1.0) -> None:
        self.store = store
        self.dspark = isinstance(drafter, DSparkDrafter)
        self.taps = list(drafter.config.tap_layers)
        self.blocks = int(blocks_per_seq)
        self.shift = drafter.label_shift
        self.bk = drafter.config.block_size
        self.weights = position_weights(self.bk, self.shift, gamma)
        self.target_norm = target.norm
        self.head = target.lm_head.weight.detach()
        self.ce_weight, self.tv_weight, self.conf_weight = ce_weight, tv_weight, conf_weight

    def _forward(self, drafter, indices: Sequence[int], generator: torch.Generator):
        fb = self.store.batch(indices, self.taps, with_last=self.dspark)
        anchors, valid = sample_anchors(fb.prompt_lengths, fb.lengths, self.blocks, generator)
        hidden = packed_block_hidden(drafter, fb.taps, fb.tokens, anchors, valid)
        labels, pos, mask = block_labels(fb.tokens, fb.lengths, anchors, valid, self.bk, self.shift)
        return fb, anchors, valid, hidden, labels, pos, mask

    def terms(self, drafter, indices: Sequence[int], generator: torch.Generator) -> dict:
        fb, anchors, valid, hidden, labels, pos, mask = self._forward(drafter, indices, generator)
        w = self.weights[None, None, :].expand_as(mask)
        if not self.dspark:
            logits = drafter.lm_logits(hidden[mask])
            ce = F.cross_entropy(logits, labels[mask], reduction="none")
            wm = w[mask]
            loss = (wm * ce).sum() / wm.sum().clamp(min=1e-6)
            correct = torch.zeros_like(mask, dtype=torch.bool)
            correct[mask] = logits.argmax(-1) == labels[mask]
            return {"loss": loss, "ce": loss.detach(), "correct": correct, "mask": mask, "positions": int(mask.sum())}
        # DSpark: whole valid blocks (the Markov chain runs along the block)
        hb, lab, m, wb = hidden[valid], labels[valid], mask[valid], w[valid]
        anchor_tok = torch.gather(fb.tokens, 1, anchors)[valid]
        prev = torch.cat([anchor_tok[:, None], lab[:, :-1]], dim=1)
        base = drafter.lm_logits(hb)
        logits = drafter.markov_block_logits(base, prev, hb)
        logq = torch.log_softmax(logits, dim=-1)
        with torch.no_grad(), full_precision():  # the target's distribution stays fp32 under bf16 autocast
            n = fb.tokens.shape[1]
            src = (pos[valid] - 1).clamp(min=0, max=n - 1)  # the target predicts a label from the position before
            owner = torch.nonzero(valid, as_tuple=False)[:, 0]  # the sample of each valid block
            h_last = fb.last[owner[:, None].expand_as(src), src]
            p_t = torch.softmax(F.linear(self.target_norm(h_last).float(), self.head.float()), dim=-1)
        ce = -logq.gather(-1, lab[..., None]).squeeze(-1)
        p_d = logq.exp()
        tv = 0.5 * (p_d - p_t).abs().sum(-1)
        conf_target = (1.0 - tv).detach().clamp(0.0, 1.0)
        z = drafter.confidence(hb, prev)
        bce = F.binary_cross_entropy_with_logits(z, conf_target, reduction="none")
        wm = (wb * m).float()
        den = wm.sum().clamp(min=1e-6)
        ce_l, tv_l, bce_l = (wm * ce).sum() / den, (wm * tv).sum() / den, (wm * bce).sum() / den
        loss = self.ce_weight * ce_l + self.tv_weight * tv_l + self.conf_weight * bce_l
        correct = torch.zeros_like(mask, dtype=torch.bool)
        correct[valid] = (logq.argmax(-1) == lab) & m
        return {"loss": loss, "ce": ce_l.detach(), "tv": tv_l.detach(), "bce": bce_l.detach(), "correct": correct,
                "mask": mask, "positions": int(mask.sum()),
                "conf_mean": float((torch.sigmoid(z.detach()) * m).sum() / m.sum().clamp(min=1)),
                "accept_mean": float((conf_target * m).sum() / m.sum().clamp(min=1))}

    def loss(self, drafter, indices: list[int], generator: torch.Generator):
        t = self.terms(drafter, indices, generator)
        return t["loss"], {"positions": t["positions"]}

    def evaluate(self, drafter, indices: Sequence[int], batch_size: int = 4, seed: int = 12345) -> dict:
        gen = torch.Generator().manual_seed(seed)  # the same anchors at every evaluation
        sums: dict[str, float] = {}
        weight = 0.0
        correct_pos = np.zeros(self.bk)
        count_pos = np.zeros(self.bk)
        leading, blocks = 0.0, 0
        for s in range(0, len(indices), batch_size):
            t = self.terms(drafter, list(indices[s:s + batch_size]), gen)
            n = t["positions"]
            if n == 0:
                continue
            for key in ("loss", "ce", "tv", "bce", "conf_mean", "accept_mean"):
                if key in t:
                    sums[key] = sums.get(key, 0.0) + float(t[key]) * n
            weight += n
            c, m = t["correct"], t["mask"]
            correct_pos += c.sum(dim=(0, 1)).numpy()
            count_pos += m.sum(dim=(0, 1)).numpy()
            first = 1 - self.shift  # index of the first draft
            run = (c[..., first:] & m[..., first:]).long().cumprod(dim=-1).sum(-1)  # leading correct drafts
            has = m[..., first]
            leading += float(run[has].sum())
            blocks += int(has.sum())
        out = {k: v / max(weight, 1) for k, v in sums.items()}
        first = 1 - self.shift
        out["acc"] = [float(x) for x in (correct_pos / np.maximum(count_pos, 1))[first:]]
        out["tau_est"] = 1.0 + leading / max(blocks, 1)
        return out


# -- CLI -------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from specrt.tools.train_common import add_common_args

    ap = argparse.ArgumentParser(prog="python -m specrt.tools.train_dflash", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("DFlash / DSpark")
    g.add_argument("--kind", choices=("dflash", "dspark"), default="dflash")
    g.add_argument("--init-from", type=Path, default=None, metavar="DRAFTER_FOLDER",
                   help="start from a trained drafter of this --kind (its architecture, fresh optimizer and schedule), "
                        "e.g. the shipped one, to train on new data; --resume wins when the run has a state")
    g.add_argument("--num-layers", type=int, default=None, help="drafter layers (default 1)")
    g.add_argument("--block-size", type=int, default=None, help="DFlash block (16) / DSpark gamma (7)")
    g.add_argument("--num-taps", type=int, default=None, help="target layers tapped (default 5, z-lab's spread)")
    g.add_argument("--blocks-per-seq", type=int, default=None, help="anchors per sequence and step (dflash 8, dspark 16)")
    g.add_argument("--loss-gamma", type=float, default=None, help="position-weight decay (default: 7*Bk/16, dspark 4*Bk/7)")
    g.add_argument("--mask-token-id", type=int, default=None, help="MASK token (default: the last vocabulary id)")
    g.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    g.add_argument("--num-kv-heads", type=int, default=None,
                   help="K/V heads of the drafter layers (default: the target's); a multiple of the target's widens "
                        "the path the context takes into the block; with --init-from, grows the start drafter's heads "
                        "by repetition (same function at step 0)")
    g.add_argument("--no-init-from-target", action="store_true", help="random layers instead of the target's last ones")
    g.add_argument("--markov-rank", type=int, default=None, help=f"DSpark Markov rank (default {DEFAULT_MARKOV_RANK})")
    g.add_argument("--markov-variant", choices=MARKOV_VARIANTS, default=None, help="DSpark Markov head (default vanilla)")
    g.add_argument("--ce-weight", type=float, default=0.1, help="DSpark CE weight")
    g.add_argument("--tv-weight", type=float, default=0.9, help="DSpark TV weight")
    g.add_argument("--conf-weight", type=float, default=1.0, help="DSpark confidence BCE weight")
    g.add_argument("--sts-blocks", type=int, default=24, help="DSpark STS: anchors per held-out sample")
    g.add_argument("--no-sts", action="store_true", help="DSpark: skip the STS calibration")
    add_common_args(ap, lr=6e-4, batch_size=4, epochs=None)
    args = ap.parse_args(argv)
    defaults = DEFAULTS[args.kind]
    if args.epochs is None:
        args.epochs = defaults["epochs"]
    if args.blocks_per_seq is None:
        args.blocks_per_seq = defaults["blocks_per_seq"]
    return args


# The drafter's shape: (argument, config field, default). With --init-from the start drafter's
# config fills what the command line leaves open, and a flag that contradicts it is refused.
ARCHITECTURE = (
    ("num_layers", "num_layers", 1),
    ("block_size", "block_size", None),  # per kind: DEFAULTS
    ("num_taps", "tap_layers", 5),  # compared as len(tap_layers)
    ("intermediate_size", "intermediate_size", None),  # None: the target's
    ("num_kv_heads", "num_kv_heads", None),  # None: the target's; --init-from may grow it (repeat_kv_heads)
    ("mask_token_id", "mask_token_id", None),  # None: the last vocabulary id
    ("markov_rank", "markov_rank", DEFAULT_MARKOV_RANK),
    ("markov_variant", "markov_variant", "vanilla"),
)


def resolve_architecture(args: argparse.Namespace, start: DFlashConfig | None) -> None:
    """Fill the architecture arguments left at None: from `start` (the --init-from drafter's config)
    when there is one, else from the defaults; then the loss decay that depends on the block size."""
    for name, field_name, default in ARCHITECTURE:
        if args.kind == "dflash" and name.startswith("markov"):
            continue
        if start is not None:
            value = getattr(start, field_name)
            value = len(value) if field_name == "tap_layers" else value
            given = getattr(args, name)
            if given is not None and given != value:
                flag = "--" + name.replace("_", "-")
                raise SpecrtError(f"--init-from {args.init_from}: its {field_name} is {value}, but {flag} {given} "
                                  "was given", f"drop {flag} (the start drafter's shape is kept) or start from scratch")
            setattr(args, name, value)
        elif getattr(args, name) is None:
            setattr(args, name, DEFAULTS[args.kind]["block_size"] if name == "block_size" else default)
    if args.loss_gamma is None:
        args.loss_gamma = default_loss_gamma(args.kind, args.block_size)


def load_start_drafter(args: argparse.Namespace, target) -> DFlashDrafter:
    """The --init-from drafter in fp32, bound to the target. With --resume and a saved state the
    loop then loads the state over these weights (the start only fixes the shape). DSpark's STS
    temperatures go back to 1: they belong to the old weights and are refitted after training."""
    from specrt.export.checkpoints.drafters import load_drafter
    from specrt.export.models.dflash import repeat_kv_heads

    drafter = load_drafter(args.init_from, target.config, kind=args.kind).float().train()
    grow_to = args.num_kv_heads
    if grow_to is not None and grow_to != drafter.config.num_kv_heads:
        drafter = repeat_kv_heads(drafter, grow_to)
        print(f"--init-from {args.init_from}: K/V heads grown to {grow_to} by repetition", file=sys.stderr)
    resolve_architecture(args, drafter.config)
    if isinstance(drafter, DSparkDrafter):
        drafter.sts_temperatures.fill_(1.0)
    drafter.bind_target(target.embed_tokens, target.lm_head)
    print(f"--init-from {args.init_from}: {args.kind} drafter loaded ({args.num_layers} layer(s), block "
          f"{args.block_size}); a fresh optimizer and schedule", file=sys.stderr)
    return drafter


def build_drafter(args: argparse.Namespace, target) -> DFlashDrafter:
    """A new drafter from the arguments (layers from the target's last ones), or the --init-from one."""
    if args.init_from is not None:
        return load_start_drafter(args, target)
    resolve_architecture(args, None)
    cfg = target.config
    torch.manual_seed(args.seed)
    if args.kind == "dflash":
        dcfg = DFlashConfig.for_target(cfg, num_layers=args.num_layers, block_size=args.block_size,
                                       mask_token_id=args.mask_token_id, num_taps=args.num_taps,
                                       intermediate_size=args.intermediate_size, num_kv_heads=args.num_kv_heads)
        drafter: DFlashDrafter = DFlashDrafter(dcfg)
    else:
        dcfg = DSparkConfig.for_target(cfg, num_layers=args.num_layers, block_size=args.block_size,
                                       mask_token_id=args.mask_token_id, num_taps=args.num_taps,
                                       intermediate_size=args.intermediate_size, markov_rank=args.markov_rank,
                                       markov_variant=args.markov_variant, num_kv_heads=args.num_kv_heads)
        drafter = DSparkDrafter(dcfg)
        with torch.no_grad():  # start the Markov bias at zero: the backbone alone is the initial drafter
            drafter.markov_w2.weight.zero_()
    if not args.no_init_from_target:
        if args.intermediate_size not in (None, cfg.intermediate_size):
            raise SpecrtError("--intermediate-size differs from the target's, so the layers cannot start from it",
                              "drop --intermediate-size or pass --no-init-from-target")
        drafter.init_from_target(target)
    drafter.bind_target(target.embed_tokens, target.lm_head)
    return drafter


def prepare(args: argparse.Namespace, target):
    """The drafter, its feature store, objective and batch plan, exactly as a run trains them
    (shared by `run` and `specrt.tools.bench_train_step`)."""
    from types import SimpleNamespace

    from specrt.tools.train_common import BatchPlan, all_drafter_taps, feature_store, frozen_target

    target = frozen_target(target)
    drafter = build_drafter(args, target)
    taps = sorted(set(all_drafter_taps(target.config.num_layers)) | set(drafter.config.tap_layers))
    store = feature_store(args, target, taps)
    objective = BlockObjective(store, target, drafter, args.blocks_per_seq, args.loss_gamma,
                               args.ce_weight, args.tv_weight, args.conf_weight)
    plan = BatchPlan(store.train_indices, store.lengths, args.batch_size, args.seed)
    return SimpleNamespace(target=target, drafter=drafter, store=store, objective=objective, plan=plan)


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
    target, drafter, store, objective, plan = prep.target, prep.drafter, prep.store, prep.objective, prep.plan
    steps = steps_for(args, plan)
    val = validation_indices(store, args.val_samples)
    result = train_loop(drafter, objective.loss, lambda m: objective.evaluate(m, val), plan,
                        LoopConfig.from_args(args, steps, args.kind), extra_state={"args": vars(args)})
    sts = None
    if args.kind == "dspark" and not args.no_sts:
        from specrt.tools.calibrate_sts import calibrate

        drafter.eval()
        sts = calibrate(drafter, store, target, validation_indices(store, 10**9), out_dir=Path(args.out),
                        blocks_per_seq=args.sts_blocks, seed=args.seed, progress=not args.no_progress)
    folder = save_final(drafter, args.out)
    summary = {
        "kind": args.kind, "drafter": str(folder), "steps": result.step, "finished": result.finished,
        "seconds": round(result.seconds, 1), "train_samples": len(store.train_indices), "val_samples": len(val),
        "validation": result.last_eval, "sts": sts, "args": vars(args),
    }
    write_summary(args.out, summary)
    if result.last_eval:
        print(f"validation: tau_est {result.last_eval['tau_est']:.3f}, accuracy per draft position "
              + " ".join(f"{a:.3f}" for a in result.last_eval["acc"]), file=sys.stderr)
    return {"drafter": drafter, "result": result, "summary": summary, "store": store}


def main(argv: Sequence[str] | None = None) -> int:
    from specrt.tools.train_common import load_target_model

    args = parse_args(argv)
    run(args, load_target_model(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
