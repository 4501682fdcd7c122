"""STS calibration of a DSpark drafter's confidence head (DESIGN.md section 3, DSpark paper).

    python -m specrt.tools.calibrate_sts --drafter runs/dspark/drafter [--data tools/data/sharegpt-smollm2]
        [--blocks-per-seq 24] [--out runs/dspark]

The runtime schedules drafts by the survival a_k = prod_{i<=k} sigmoid(z_i / T_i): the estimated
probability that drafts 1..k are all accepted. STS (sequential temperature scaling) picks, per
draft position and left to right, the temperature T_k from the grid 2^(i/10), i = -30..30, that
minimises the expected calibration error (20 equal-width bins) of a_k against the empirical
survival s_k = 1[drafts 1..k all accepted], with T_1..T_{k-1} already fixed. Ties go to the
temperature closest to 1.

Data: held-out samples only (the 5 % split of `specrt.tools.train_features`), `--blocks-per-seq`
random anchors in each response. Every block is drafted exactly as at inference: one backbone
pass, then the greedy Markov chain (prev = the drafter's own previous token), the confidence
logit z_k of each position with that prev. A draft is accepted under greedy verification when it
equals the target's argmax at its position (`lm_head(norm(h_L))` of the cached last hidden state);
only blocks whose gamma labels all lie inside the sequence are used.

Output: a table of T_k and the ECE per position before (all T = 1) and after, the pooled ECE,
`sts.json` and `sts_reliability.png` (reliability diagram of the survival probabilities, pooled over
positions, before and after) in the output folder, and the temperatures in the drafter: the
`sts_temperatures` buffer, which `save_drafter` writes into config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

GRID = 2.0 ** (np.arange(-30, 31) / 10.0)
BINS = 20


def expected_calibration_error(probs: np.ndarray, outcomes: np.ndarray, bins: int = BINS) -> float:
    """ECE with `bins` equal-width bins: sum_b (n_b / n) |mean(probs in b) - mean(outcomes in b)|."""
    probs = np.asarray(probs, dtype=np.float64).ravel()
    outcomes = np.asarray(outcomes, dtype=np.float64).ravel()
    if probs.size == 0:
        return 0.0
    idx = np.clip((probs * bins).astype(np.int64), 0, bins - 1)
    gap = np.bincount(idx, weights=probs - outcomes, minlength=bins)
    return float(np.abs(gap).sum() / probs.size)


def _ece_many(probs: np.ndarray, outcomes: np.ndarray, bins: int) -> np.ndarray:
    """ECE of each row of probs [G, n] against outcomes [n]."""
    g, n = probs.shape
    if n == 0:
        return np.zeros(g)
    idx = np.clip((probs * bins).astype(np.int64), 0, bins - 1) + np.arange(g)[:, None] * bins
    gap = np.bincount(idx.ravel(), weights=(probs - outcomes[None, :]).ravel(), minlength=g * bins)
    return np.abs(gap.reshape(g, bins)).sum(axis=1) / n


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def survival_probs(conf_logits: np.ndarray, temps: np.ndarray) -> np.ndarray:
    """a_k = prod_{i<=k} sigmoid(z_i / T_i) for conf_logits [n, K]."""
    return np.cumprod(sigmoid(np.asarray(conf_logits, dtype=np.float64) / np.asarray(temps)[None, :]), axis=1)


def fit_sts(conf_logits: np.ndarray, survived: np.ndarray, grid: np.ndarray = GRID, bins: int = BINS):
    """Sequential temperature scaling. Returns (temps [K], ece_before [K], ece_after [K])."""
    z = np.asarray(conf_logits, dtype=np.float64)
    s = np.asarray(survived, dtype=np.float64)
    n, k_max = z.shape
    grid = np.asarray(grid, dtype=np.float64)
    temps = np.ones(k_max)
    prefix = np.ones(n)
    closeness = np.abs(np.log(grid))
    for k in range(k_max):
        cand = prefix[None, :] * sigmoid(z[None, :, k] / grid[:, None])  # [G, n]
        eces = _ece_many(cand, s[:, k], bins)
        best = np.flatnonzero(eces <= eces.min() + 1e-12)
        choice = best[np.argmin(closeness[best])]
        temps[k] = grid[choice]
        prefix = cand[choice]
    before = survival_probs(z, np.ones(k_max))
    after = survival_probs(z, temps)
    ece_before = np.array([expected_calibration_error(before[:, k], s[:, k], bins) for k in range(k_max)])
    ece_after = np.array([expected_calibration_error(after[:, k], s[:, k], bins) for k in range(k_max)])
    return temps, ece_before, ece_after


@torch.no_grad()
def collect_survival(drafter, store, target, indices: Sequence[int], blocks_per_seq: int = 24, seed: int = 0,
                     batch_size: int = 4, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Confidence logits z [n, gamma] of greedy drafting and the empirical survival s [n, gamma]."""
    import torch.nn.functional as F
    from specrt.tools.dflash_blocks import packed_block_hidden, sample_anchors
    from tqdm import tqdm

    gamma = drafter.config.block_size
    taps = list(drafter.config.tap_layers)
    head = target.lm_head.weight.detach().float()
    gen = torch.Generator().manual_seed(int(seed) + 777)
    zs, ss = [], []
    chunks = [list(indices[i:i + batch_size]) for i in range(0, len(indices), batch_size)]
    for chunk in tqdm(chunks, desc="STS: drafting held-out blocks", unit="batch", file=sys.stderr, disable=not progress):
        fb = store.batch(chunk, taps, with_last=True)
        anchors, valid = sample_anchors(fb.prompt_lengths, fb.lengths, blocks_per_seq, gen)
        valid = valid & (anchors + gamma <= (fb.lengths - 1)[:, None])  # all gamma labels inside the sequence
        if not bool(valid.any()):
            continue
        hidden = packed_block_hidden(drafter, fb.taps, fb.tokens, anchors, valid)[valid]  # [nv, gamma, H]
        owner = torch.nonzero(valid, as_tuple=False)[:, 0]
        a = anchors[valid]
        src = a[:, None] + torch.arange(gamma)[None, :]  # the target predicts label a+k+1 from position a+k
        h_last = fb.last[owner[:, None].expand_as(src), src]
        target_next = F.linear(target.norm(h_last).float(), head).argmax(-1)
        base = drafter.lm_logits(hidden)
        prev = fb.tokens[owner, a]
        state = None
        z_rows, accepted = [], []
        for k in range(gamma):
            logits, state = drafter.markov_step(base[:, k], prev, hidden[:, k], state)
            z_rows.append(drafter.confidence(hidden[:, k], prev))
            token = logits.argmax(-1)
            accepted.append(token == target_next[:, k])
            prev = token
        zs.append(torch.stack(z_rows, 1).float().numpy())
        ss.append(torch.stack(accepted, 1).long().cumprod(1).numpy())
    if not zs:
        return np.zeros((0, gamma)), np.zeros((0, gamma))
    return np.concatenate(zs), np.concatenate(ss).astype(np.float64)


def reliability_plot(path: Path, before: np.ndarray, after: np.ndarray, survived: np.ndarray, bins: int = BINS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k--", linewidth=0.8, label="perfect")
    for probs, label, color in ((before, "before STS", "tab:red"), (after, "after STS", "tab:green")):
        p, o = probs.ravel(), survived.ravel()
        idx = np.clip((p * bins).astype(np.int64), 0, bins - 1)
        counts = np.bincount(idx, minlength=bins)
        used = counts > 0
        mean_p = np.bincount(idx, weights=p, minlength=bins)[used] / counts[used]
        mean_o = np.bincount(idx, weights=o, minlength=bins)[used] / counts[used]
        ax.plot(mean_p, mean_o, "o-", color=color,
                label=f"{label} (ECE {expected_calibration_error(p, o, bins):.3f})")
    ax.set_xlabel("predicted survival prod sigmoid(z/T)")
    ax.set_ylabel("empirical survival (all drafts so far accepted)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title("DSpark confidence calibration (held-out)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(temps, ece_before, ece_after, before, after, survived) -> str:
    lines = ["draft  T_k     ECE before  ECE after  mean a_k before  after  empirical s_k"]
    for k in range(len(temps)):
        lines.append(f"{k + 1:5d}  {temps[k]:6.3f}  {ece_before[k]:10.4f}  {ece_after[k]:9.4f}  "
                     f"{before[:, k].mean():15.4f}  {after[:, k].mean():5.4f}  {survived[:, k].mean():13.4f}")
    lines.append(f"pooled         {expected_calibration_error(before, survived):10.4f}  "
                 f"{expected_calibration_error(after, survived):9.4f}")
    return "\n".join(lines)


def calibrate(drafter, store, target, indices: Sequence[int], out_dir: Path | None = None, blocks_per_seq: int = 24,
              seed: int = 0, grid: np.ndarray = GRID, bins: int = BINS, progress: bool = True) -> dict:
    """Fit STS on held-out blocks, store the temperatures in `drafter.sts_temperatures`, report."""
    target = getattr(target, "model", target)
    was_training = drafter.training
    drafter.eval()
    z, s = collect_survival(drafter, store, target, indices, blocks_per_seq, seed, progress=progress)
    drafter.train(was_training)
    if len(z) == 0:
        print("STS: no held-out block to calibrate on; temperatures stay 1", file=sys.stderr)
        return {"blocks": 0}
    temps, ece_before, ece_after = fit_sts(z, s, grid, bins)
    with torch.no_grad():
        drafter.sts_temperatures.copy_(torch.tensor(temps, dtype=drafter.sts_temperatures.dtype))
    before = survival_probs(z, np.ones(len(temps)))
    after = survival_probs(z, temps)
    table = format_table(temps, ece_before, ece_after, before, after, s)
    print(f"STS calibration on {len(z)} held-out blocks:\n{table}", file=sys.stderr)
    report = {
        "blocks": len(z), "temperatures": [float(t) for t in temps],
        "ece_before": [float(e) for e in ece_before], "ece_after": [float(e) for e in ece_after],
        "ece_pooled_before": expected_calibration_error(before, s, bins),
        "ece_pooled_after": expected_calibration_error(after, s, bins),
        "empirical_survival": [float(x) for x in s.mean(0)],
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sts.json").write_text(json.dumps(report, indent=2) + "\n")
        try:
            reliability_plot(out_dir / "sts_reliability.png", before, after, s, bins)
        except ImportError:
            pass
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specrt.tools.calibrate_sts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, required=True, help="DSpark drafter folder (config.json + model.safetensors)")
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data" / "sharegpt-smollm2")
    ap.add_argument("--target", default=None, help="target checkpoint (default: embedded SmolLM2)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: the drafter's parent)")
    ap.add_argument("--blocks-per-seq", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from specrt.export.checkpoints.drafters import load_drafter, save_drafter
    from specrt.tools.train_common import all_drafter_taps, load_target_model
    from specrt.tools.train_features import ensure_features

    target = load_target_model(args)
    drafter = load_drafter(args.drafter, target.config, kind="dspark")
    drafter.bind_target(target.embed_tokens, target.lm_head)
    taps = sorted(set(all_drafter_taps(target.config.num_layers)) | set(drafter.config.tap_layers))
    store = ensure_features(args.data, target, taps, cache_dir=args.cache_dir, progress=not args.no_progress)
    indices = [int(i) for i in store.val_indices]
    calibrate(drafter, store, target, indices, args.out or args.drafter.parent, args.blocks_per_seq, args.seed,
              progress=not args.no_progress)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        json.loads((args.drafter / "config.json").read_text()).get("torch_dtype"), torch.float16)
    save_drafter(drafter, args.drafter, dtype=dtype)
    print(f"temperatures written to {args.drafter / 'config.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
