"""`specrt generate`: load engines (or a checkpoint), apply the chat template, stream the answer, print stats.

    specrt generate --engines engines/NAME --prompt "Why is the sky blue?"      (ONNX Runtime)
    specrt generate --backend torch --drafter dspark --drafter-ckpt PATH --prompt "..."

The text goes to stdout as it is produced; the stats line (`tau 2.31 | 41.2 tok/s | 128 tokens`)
and load messages go to stderr, so `specrt generate ... > answer.txt` captures the text alone.
With `--speedup` the same prompt is then decoded without the drafter on the same engine and the
ratio of the two rates is printed (greedy: with a check that the outputs are identical).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from specrt.tools.draft_flags import add_draft_arguments, resolve_draft_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="user message (default: read stdin)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    d = add_model_arguments(p, backends=("auto", "ort", "trt", "torch"))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--capacity", type=int, default=None, help="KV cache slots (default: prompt + max-new-tokens + margin)")
    d.add_argument("--speedup", action="store_true",
                   help="afterwards, time plain decoding of the same prompt and print the speedup")


def add_model_arguments(p: argparse.ArgumentParser, backends=("auto", "ort", "torch")):
    """Where the model comes from and how it drafts: shared by generate, serve and calibrate.

    Returns the "speculative decoding" group so a subcommand can add its own drafting flags to it.
    """
    p.add_argument("--engines", help="engine folder written by `specrt export` (implies --backend ort)")
    p.add_argument("--backend", default="auto", choices=list(backends),
                   help="auto: ort with --engines, torch otherwise" + ("; trt: the folder's TensorRT plans "
                                                                      "(specrt build)" if "trt" in backends else ""))
    p.add_argument("--target", help="torch backend: HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (torch device or ORT's CUDA EP) or tensorrt (ORT's TensorRT EP)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="weight dtype for the torch backend")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the backend's choice)")
    p.add_argument("--no-verify", action="store_true", help="ort: skip the sha256 check of the engine files at load")
    d = p.add_argument_group("speculative decoding", "each drafting flag given overrides the engine folder's recorded default of the same name; the rest stay the folder's")
    d.add_argument("--drafter", default="auto", choices=["auto", "none", "eagle3", "dflash", "dspark", "lookup"],
                   help="auto (engine folders): each step, whichever of plain decoding, copies from the text and "
                   "the folder's drafter measures the most tokens/s (torch: none); none: plain decoding; lookup: "
                   "no drafter, drafts copied from the prompt and the text so far; a kind: that drafter (with a note "
                   "when the automatic choice measured faster)")
    d.add_argument("--drafter-ckpt", help="drafter folder (config.json + model.safetensors, official format)")
    d.add_argument("--fast-plain", action="store_true",
                   help="with --drafter none on an int4/int8/w8a8 engine folder: one-row decoding steps, ~10%% "
                   "faster, whose text can differ in rounding from what speculation gives (by default plain "
                   "decoding there rounds as a verify step does, so every drafter reproduces it; docs/exactness.md)")
    add_draft_arguments(d)
    return d


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_backend(args: argparse.Namespace) -> str:
    from specrt.plugins.errors import SpecrtError

    backend = args.backend
    if backend == "auto":
        backend = "ort" if args.engines else "torch"
    if backend in ("ort", "trt") and not args.engines:
        raise SpecrtError(f"--backend {backend} needs --engines FOLDER",
                          "export engines first: specrt export --drafter KIND --out engines/NAME")
    if backend == "torch" and args.engines:
        raise SpecrtError("--engines is for the ort backend", "drop --backend torch, or pass --target for torch")
    return backend


def build_pipeline(args: argparse.Namespace, options):
    from specrt.plugins.errors import SpecrtError
    from specrt.runtime.pipeline import Pipeline

    backend = resolve_backend(args)
    if getattr(args, "fast_plain", False) and (backend != "ort" or args.drafter != "none"):
        raise SpecrtError("--fast-plain changes how plain decoding rounds on an engine folder: it needs "
                          f"--engines and --drafter none (got backend {backend}, --drafter {args.drafter})",
                          "add --drafter none, or drop --fast-plain")
    if backend == "trt":
        from specrt.runtime.backends.trt_backend import trt_pipeline

        return trt_pipeline(args.engines, options)
    if backend == "ort":
        # a named drafter is measured against the automatic choice in probe rounds (the note after the stats)
        return Pipeline.from_engines(args.engines, device=args.device, threads=args.threads, drafter=args.drafter,
                                     exact_plain=not getattr(args, "fast_plain", False),
                                     draft_options=options, verify_checksums=not args.no_verify)
    drafter = "none" if args.drafter == "auto" else args.drafter
    return Pipeline.from_checkpoint(args.target, drafter, args.drafter_ckpt, args.device, DTYPES[args.dtype], options)


def load_pipeline(args: argparse.Namespace):
    """The pipeline of serve, calibrate and the Ray replicas: drafting options resolved, batch mode and
    host threads set for a server."""
    import torch
    from specrt.runtime.serving.loading import serving_pipeline, set_batch_mode
    from specrt.tools.draft_flags import resolve_draft_options

    options = resolve_draft_options(args, args.engines)  # bad values fail before loading
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = serving_pipeline(build_pipeline(args, options))
    set_batch_mode(pipe, getattr(args, "shared_batches", False))
    if pipe.host_threads is not None:
        # the engine thread does torch host work between ORT calls: one thread (runtime/host_threads.py)
        torch.set_num_threads(pipe.host_threads)
    return pipe


def run(args: argparse.Namespace) -> int:
    from specrt.plugins.errors import SpecrtError
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.stats import summary_line
    from specrt.runtime.streaming import TextStream

    # validate everything cheap before loading anything
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    options = resolve_draft_options(args, args.engines)
    if args.max_new_tokens < 1:
        raise SpecrtError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}", "ask for at least one token")
    resolve_backend(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    start = time.perf_counter()
    pipe = build_pipeline(args, options)
    print(f"loaded {pipe.name} ({pipe.backend}) in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if pipe.proposer is not None:
        print(f"drafter: {pipe.proposer.name}", file=sys.stderr)
    ids = pipe.encode(prompt, args.system, not args.no_chat_template)
    if args.speedup and pipe.proposer is not None:
        # untimed warm-up of both paths: ONNX Runtime's first calls at new shapes allocate and plan, and
        # whichever run came first would carry that cost in the ratio
        for speculative in (True, False):
            pipe.generate_ids([ids[:32]], 8, sampling, speculative=speculative, capacity=args.capacity)
    stream = TextStream(pipe.tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    start = time.perf_counter()
    result = pipe.generate_ids([ids], args.max_new_tokens, sampling, True, lambda row, new: stream.push(new),
                               capacity=args.capacity)
    stream.close()
    wall = time.perf_counter() - start
    sys.stdout.write("\n")
    print(summary_line(result.stats, wall), file=sys.stderr)
    note = getattr(pipe.proposer, "slower_note", lambda: None)()
    if note:  # a named drafter that the automatic choice would have beaten on this request
        print(note, file=sys.stderr)
    if args.speedup and pipe.proposer is not None:
        start = time.perf_counter()
        plain = pipe.generate_ids([ids], args.max_new_tokens, sampling, speculative=False, capacity=args.capacity)
        plain_wall = time.perf_counter() - start
        if not sampling.greedy:
            same = "sampled: each run draws its own tokens"
        else:
            same = "identical output" if plain.tokens == result.tokens else "OUTPUT DIFFERS (a bug: please report)"
        spec_rate = result.stats[0].new_tokens / wall
        plain_rate = plain.stats[0].new_tokens / plain_wall
        print(f"plain decoding: {plain_rate:.1f} tok/s | speedup {spec_rate / plain_rate:.2f}x | {same}",
              file=sys.stderr)
    return 0
