"""What the three drafter trainers share: seeds, optimiser and schedule, batches, the resumable
training loop, loss curves, and the final fp16 checkpoint.

The loop (`train_loop`):
- AdamW (betas 0.9/0.95, weight decay on matrices only) with a linear warmup then a cosine decay to
  `min_lr_ratio * lr`, gradient clipping at `grad_clip`.
- Time budget (`--max-minutes`, default 110 so every run stays under 2 hours): the cosine follows
  the training progress, max(steps done / steps, time spent / budget), so a run that would not
  finish its steps in time anneals anyway and ends at the budget with a finished schedule instead
  of being cut mid-way. A run that completes its steps inside the budget is exactly the step-based
  schedule (and bit-reproducible; when the budget binds, where it stops depends on the machine).
  Progress is monotone and saved with the state, so a resumed run continues the same curve.
- Batches are a pure function of (seed, step) (`BatchPlan`: per epoch a seeded permutation,
  bucketed by length so padding stays small), and every step gets its own torch.Generator seeded
  from (seed, step) for the random parts of the objective (anchors). A resumed run therefore takes
  exactly the batches and anchors the uninterrupted run would have taken.
- State (`<out>/train_state.pt`: trainable module state, optimizer, step, progress, RNG states,
  loss history, seconds spent) is written every `save_every` steps and at the end (steps done or
  budget spent); `--resume` continues from it (with `--steps`/`--epochs` raised, a finished run
  trains on).
- Every `eval_every` steps and at the end the trainer's eval function runs on the held-out split.
  `<out>/losses.csv` (step, train loss, learning rate, validation loss, seconds) and
  `<out>/loss_curve.png` (train loss, its moving average, validation loss) are rewritten at each
  evaluation; `<out>/metrics.jsonl` keeps every validation record (per-position accuracies ...).
- At the end (or when the budget runs out) the drafter goes to `<out>/drafter/` in its official
  format, fp16 safetensors (`save_drafter`).
- Precision (`--precision`): `bf16` runs the training forward under torch.autocast (bfloat16
  matmuls, fp32 weights, optimizer, residual stream, norms and losses); the objectives compute the
  target's distributions (the labels) in fp32 outside autocast, and validation always runs in fp32
  so its numbers compare across runs and with the fp32 runtime. Why: on a CPU with AVX512-BF16 (this
  machine) a bf16 matmul runs ~4x faster than fp32 on one thread (226-267 against 60-64 GFLOP/s,
  2048x576 @ 576x8192), and the drafters' steps are matmul-bound. `auto` (default) picks bf16 on a
  CUDA device or a CPU whose flags list avx512_bf16 / amx_bf16, else fp32 (bf16 emulated in
  software would be slower). The choice is printed and stored with the run's arguments.

tqdm shows the loss (moving average), the supervised positions per second and the learning rate.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specrt.plugins.errors import SpecrtError

STATE_FILE = "train_state.pt"


# -- seeds, schedule, optimiser ----------------------------------------------------------------
def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one training step: a pure function of (seed, step)."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % 2**63)


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float, progress: float | None = None) -> float:
    """LR multiplier: linear warmup over the first `warmup` of `total` steps, then a cosine from 1 to
    `min_ratio`, both over the training progress in [0, 1] (default: step / total; the loop passes
    max(step / total, time spent / budget) when a time budget is set).
    """
    if progress is None:
        progress = step / max(total, 1)
    w = warmup / max(total, 1)
    if warmup > 0 and progress < w:
        return min(1.0, max((step + 1) / warmup, progress / w))
    progress = min(max((progress - w) / max(1.0 - w, 1e-9), 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    # the grouping below fixes the optimizer's state indices; optimizer_slots must follow it
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def optimizer_slots(model: torch.nn.Module) -> list[str]:
    """Parameter names in the order of the optimizer's state indices (the groups of make_optimizer),
    so a saved optimizer state can be edited per parameter (the EAGLE-3 vocabulary re-map)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]


# -- batches -------------------------------------------------------------------------------------
class BatchPlan:
    """Batches of sample indices as a pure function of the step.

    Per epoch: a permutation seeded by (seed, epoch), cut into chunks of 32 batches, each chunk
    sorted by length (similar lengths share a batch, little padding) and the batches of the epoch
    shuffled again. The last incomplete batch of an epoch is dropped.
    """

    def __init__(self, indices: Sequence[int], lengths: Sequence[int], batch_size: int, seed: int) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)
        if len(self.indices) == 0:
            raise SpecrtError("no training samples", "build a larger data set")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = max(1, min(int(batch_size), len(self.indices)))
        self.seed = int(seed)
        self.steps_per_epoch = len(self.indices) // self.batch_size
        self._cache: tuple[int, list[list[int]]] | None = None

    def _epoch(self, epoch: int) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = self.indices[rng.permutation(len(self.indices))]
        chunk = self.batch_size * 32
        batches: list[list[int]] = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start:start + chunk].tolist(), key=lambda i: int(self.lengths[i]))
            batches += [part[j:j + self.batch_size] for j in range(0, len(part), self.batch_size)]
        batches = [b for b in batches if len(b) == self.batch_size][: self.steps_per_epoch]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        self._cache = (epoch, batches)
        return batches

    def __call__(self, step: int) -> list[int]:
        epoch, within = divmod(int(step), self.steps_per_epoch)
        return self._epoch(epoch)[within]


def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """--precision auto|fp32|bf16 -> fp32 or bf16 (auto: bf16 where the hardware runs it fast)."""
    if precision not in ("auto", "fp32", "bf16"):
        raise SpecrtError(f"unknown --precision {precision!r}", "use auto, fp32 or bf16")
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        return "bf16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def autocast(precision: str, device: str = "cpu"):
    """The training forward's autocast context (a no-op context for fp32)."""
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")


def full_precision(device: str = "cpu"):
    """Turns autocast off inside a bf16 forward: label distributions are computed in fp32."""
    return torch.autocast(device_type=device.split(":")[0], enabled=False)


def steps_for(args: argparse.Namespace, plan: BatchPlan) -> int:
    """--steps when given, else --epochs over the training split."""
    if getattr(args, "steps", None):
        return int(args.steps)
    return max(1, int(round(float(args.epochs) * plan.steps_per_epoch)))


# -- CLI pieces ----------------------------------------------------------------------------------
def add_common_args(ap: argparse.ArgumentParser, **defaults: Any) -> None:
    d = dict(epochs=2.0, batch_size=4, lr=3e-4, warmup=0.03, min_lr_ratio=0.1, weight_decay=0.0,
             grad_clip=1.0, save_every=200, eval_every=250, val_samples=48, seed=0)
    d.update(defaults)
    g = ap.add_argument_group("training (shared by every drafter)")
    from specrt.tools.build_data import DEFAULT_OUT

    g.add_argument("--data", type=Path, nargs="+", default=[DEFAULT_OUT],
                   help="built data set folder(s) (python -m specrt.tools.build_data); several are trained on as one")
    g.add_argument("--out", type=Path, required=True, help="run folder: state, curves, drafter/")
    g.add_argument("--target", default=None, help="target checkpoint (HF folder or .gguf); default: embedded SmolLM2")
    g.add_argument("--cache-dir", type=Path, default=None,
                   help="feature cache folder (default ~/.cache/specrt/features/<hash>); with several --data, "
                        "each set's cache is <cache-dir>/<hash>")
    g.add_argument("--epochs", type=float, default=d["epochs"], help="passes over the training split (default: %(default)s; None = the trainer's own)")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], help="sequences per step (default %(default)s)")
    g.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (default %(default)s)")
    g.add_argument("--warmup", type=float, default=d["warmup"], help="warmup fraction of the steps (default %(default)s)")
    g.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"])
    g.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    g.add_argument("--grad-clip", type=float, default=d["grad_clip"])
    g.add_argument("--save-every", type=int, default=d["save_every"], help="steps between state saves")
    g.add_argument("--eval-every", type=int, default=d["eval_every"], help="steps between validations")
    g.add_argument("--val-samples", type=int, default=d["val_samples"], help="held-out samples per validation")
    g.add_argument("--max-minutes", type=float, default=d.get("max_minutes", 110.0),
                   help="time budget of this invocation (default %(default)s): the LR schedule anneals by "
                   "steps or time, whichever is further, and the run ends when either is spent")
    g.add_argument("--stop-at-step", type=int, default=None, help=argparse.SUPPRESS)  # simulated interruption (tests)
    g.add_argument("--resume", action="store_true", help="continue from <out>/train_state.pt")
    g.add_argument("--seed", type=int, default=d["seed"])
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="training forward precision: bf16 autocast (fp32 weights and optimizer) or fp32; "
                        "auto = bf16 on a CUDA GPU or a CPU with native bf16 (avx512_bf16/amx), else fp32")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def load_target_model(args: argparse.Namespace):
    from specrt.export.checkpoints import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    return frozen_target(load_target(args.target))


def frozen_target(target):
    """The target model (of a loaded checkpoint or as is) in eval mode with no gradients: trainers
    read its features and heads, never train it."""
    model = getattr(target, "model", target).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def feature_store(args: argparse.Namespace, target, tap_layers: Sequence[int]):
    """The feature store of `--data`: one set's store, or several sets' stores seen as one."""
    from specrt.tools.train_features import ConcatFeatureStore, dataset_hash, ensure_features

    folders = [Path(f) for f in (args.data if isinstance(args.data, (list, tuple)) else [args.data])]
    if len(folders) == 1:
        return ensure_features(folders[0], target, tap_layers, cache_dir=args.cache_dir, progress=not args.no_progress)
    if len({f.resolve() for f in folders}) != len(folders):
        raise SpecrtError(f"--data names a folder twice: {[str(f) for f in folders]}", "name each data set once")
    stores = []
    for folder in folders:
        cache = None if args.cache_dir is None else Path(args.cache_dir) / dataset_hash(folder)[:16]
        stores.append(ensure_features(folder, target, tap_layers, cache_dir=cache, progress=not args.no_progress))
    return ConcatFeatureStore(stores)


def all_drafter_taps(num_layers: int) -> list[int]:
    """The union of the default taps of the three drafters: one feature cache serves them all."""
    from specrt.export.models.dflash import default_dflash_taps
    from specrt.export.models.eagle3 import default_eagle3_taps

    return sorted(set(default_eagle3_taps(num_layers)) | set(default_dflash_taps(num_layers)))


def validation_indices(store, count: int) -> list[int]:
    """The first `count` held-out samples (fixed across evaluations); falls back to training samples
    (with a note) when the data set is too small to hold any out."""
    val = list(store.val_indices[:count])
    if not val:
        print("note: no held-out samples in this data set; validating on training samples", file=sys.stderr)
        val = list(store.train_indices[:count])
    return [int(i) for i in val]


# -- the loop ----------------------------------------------------------------------------------
@dataclass
class LoopConfig:
    out: Path
    steps: int
    lr: float
    warmup: float = 0.03
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    save_every: int = 200
    eval_every: int = 250
    max_minutes: float | None = None  # None or <= 0: no budget
    resume: bool = False
    seed: int = 0
    stop_at_step: int | None = None
    progress: bool = True
    desc: str = "train"
    precision: str = "fp32"  # resolved: fp32 or bf16 (the training forward's autocast)

    @classmethod
    def from_args(cls, args: argparse.Namespace, steps: int, desc: str) -> LoopConfig:
        # the resolved precision goes back into args, so the run's summary records what ran, not "auto"
        args.precision = resolve_precision(getattr(args, "precision", "fp32"))
        return cls(out=Path(args.out), steps=steps, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                   weight_decay=args.weight_decay, grad_clip=args.grad_clip, save_every=args.save_every,
                   eval_every=args.eval_every, max_minutes=args.max_minutes, resume=args.resume, seed=args.seed,
                   stop_at_step=args.stop_at_step, progress=not args.no_progress, desc=desc,
                   precision=args.precision)


@dataclass
class LoopResult:
    step: int
    finished: bool  # the schedule is complete (all steps, or the time budget spent)
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    last_eval: dict[str, Any] | None = None
    seconds: float = 0.0


LossFn = Callable[[torch.nn.Module, list[int], torch.Generator], tuple[torch.Tensor, dict[str, float]]]
EvalFn = Callable[[torch.nn.Module], dict[str, Any]]


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_state(path: Path, model, optimizer, step: int, total: int, progress: float, history, seconds: float,
               extra) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "total_steps": total,
        "progress": progress, "rng": _rng_state(), "history": history, "seconds": seconds, "extra": extra,
    }, tmp)
    tmp.replace(path)


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def train_loop(
    model: torch.nn.Module,
    loss_fn: LossFn,
    eval_fn: EvalFn,
    plan: BatchPlan,
    cfg: LoopConfig,
    extra_state: dict[str, Any] | None = None,
) -> LoopResult:
    from tqdm import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SpecrtError("the drafter has no trainable parameters", "check requires_grad of its modules")
    set_seed(cfg.seed)
    optimizer = make_optimizer(params, cfg.lr, cfg.weight_decay)
    warmup_steps = int(round(cfg.warmup * cfg.steps))
    step, progress, seconds_before = 0, 0.0, 0.0
    history: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    if cfg.resume and state_path.exists():
        state = load_state(state_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        step, history, seconds_before = int(state["step"]), state["history"], float(state["seconds"])
        progress = float(state["progress"])
        if progress >= 1.0 and cfg.steps > int(state.get("total_steps", step)):
            progress = step / cfg.steps  # a finished run, asked for more steps: train on
        print(f"resuming {out} at step {step}", file=sys.stderr)
    else:
        if cfg.resume:
            print(f"--resume: no {state_path} yet, starting from step 0", file=sys.stderr)
        (out / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run: no records of an earlier one

    start = time.perf_counter()
    budget = cfg.max_minutes * 60.0 if cfg.max_minutes and cfg.max_minutes > 0 else None
    progress0 = progress
    last_eval: dict[str, Any] | None = history["val"][-1] if history["val"] else None
    ema = None
    positions = 0
    print(f"[{cfg.desc}] training forward in {cfg.precision}", file=sys.stderr)
    bar = tqdm(total=cfg.steps, initial=step, desc=cfg.desc, unit="step", file=sys.stderr, disable=not cfg.progress,
               dynamic_ncols=True)

    def checkpoint() -> None:
        save_state(state_path, model, optimizer, step, cfg.steps, progress, history,
                   seconds_before + time.perf_counter() - start, extra_state)

    def evaluate() -> None:
        nonlocal last_eval
        model.eval()
        with torch.no_grad():
            metrics = eval_fn(model)
        model.train()
        last_eval = {"step": step, **metrics}
        history["val"].append(last_eval)
        with open(out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(last_eval) + "\n")
        write_curves(out, history)
        bar.write(f"[{cfg.desc}] step {step}: " + format_metrics(metrics))

    def current_progress() -> float:
        p = step / cfg.steps
        if budget is not None:
            p = max(p, progress0 + (time.perf_counter() - start) / budget * (1.0 - progress0))
        return min(max(progress, p), 1.0)

    model.train()
    stopped = False
    try:
        while progress < 1.0:
            if cfg.stop_at_step is not None and step >= cfg.stop_at_step:
                stopped = True
                break
            lr = cfg.lr * warmup_cosine(step, cfg.steps, warmup_steps, cfg.min_lr_ratio, progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = plan(step)
            with autocast(cfg.precision):
                loss, metrics = loss_fn(model, batch, step_generator(cfg.seed, step))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip and cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            step += 1
            progress = current_progress()
            value = float(loss.detach())
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            positions += int(metrics.get("positions", 0))
            elapsed = time.perf_counter() - start
            history["train"].append({"step": step, "loss": value, "lr": lr,
                                     "seconds": round(seconds_before + elapsed, 2)})
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", pos_s=f"{positions / max(elapsed, 1e-6):.0f}", lr=f"{lr:.1e}")
            if progress >= 1.0 and step < cfg.steps:
                bar.write(f"[{cfg.desc}] time budget of {cfg.max_minutes} min spent at step {step} "
                          "(the schedule annealed on time)")
            if cfg.eval_every and step % cfg.eval_every == 0 and progress < 1.0:
                evaluate()
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()
        if not stopped and (last_eval is None or last_eval["step"] != step):
            evaluate()
    finally:
        bar.close()
    checkpoint()
    write_curves(out, history)
    return LoopResult(step, progress >= 1.0, history, last_eval, seconds_before + time.perf_counter() - start)


def format_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4f}")
        elif isinstance(value, (list, tuple)):
            parts.append(f"{key}=[" + " ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value) + "]")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


# -- curves --------------------------------------------------------------------------------------
def write_curves(out: Path, history: dict[str, list[dict[str, Any]]]) -> None:
    """losses.csv and loss_curve.png of a run (train loss per step, validation loss per evaluation)."""
    out = Path(out)
    val = {int(r["step"]): r for r in history.get("val", [])}
    with open(out / "losses.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", "train_loss", "lr", "val_loss", "seconds"])
        seen = set()
        for r in history.get("train", []):
            v = val.get(int(r["step"]))
            seen.add(int(r["step"]))
            writer.writerow([r["step"], f"{r['loss']:.6f}", f"{r['lr']:.3e}",
                             "" if v is None else f"{v['loss']:.6f}", r["seconds"]])
        for s, v in sorted(val.items()):
            if s not in seen:
                writer.writerow([s, "", "", f"{v['loss']:.6f}", ""])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the train extra is not installed: the CSV is still there
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    train = history.get("train", [])
    if train:
        steps = [r["step"] for r in train]
        losses = np.array([r["loss"] for r in train])
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
        if len(losses) > 5:
            k = max(5, len(losses) // 50)
            smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1:], smooth, color="tab:blue", label=f"train (mean of {k})")
    if val:
        ax.plot(list(val), [v["loss"] for v in val.values()], "o-", color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(out.name)
    ax.grid(alpha=0.3)
    if train or val:  # a run stopped before its first step has nothing to label
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=110)
    plt.close(fig)


def save_final(model, out: Path) -> Path:
    """The drafter in its official format, fp16 safetensors, in <out>/drafter/."""
    from specrt.export.checkpoints.drafters import save_drafter

    return save_drafter(model, Path(out) / "drafter", dtype=torch.float16)


def write_summary(out: Path, data: dict[str, Any]) -> None:
    (Path(out) / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")


__all__ = [
    "BatchPlan",
    "LoopConfig",
    "LoopResult",
    "add_common_args",
    "all_drafter_taps",
    "autocast",
    "cpu_has_fast_bf16",
    "feature_store",
    "format_metrics",
    "frozen_target",
    "full_precision",
    "load_target_model",
    "make_optimizer",
    "save_final",
    "set_seed",
    "step_generator",
    "steps_for",
    "train_loop",
    "validation_indices",
    "warmup_cosine",
    "write_curves",
    "write_summary",
]
