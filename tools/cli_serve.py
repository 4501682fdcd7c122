"""`specrt serve`: an OpenAI-compatible HTTP server over batched speculative decoding.

    specrt serve --engines engines/NAME                       (ONNX Runtime, the folder's drafter)
    specrt serve --backend torch --drafter dspark --drafter-ckpt runs/dspark/drafter
    specrt serve --engines engines/NAME --drafter none        (plain decoding)

Endpoints and behaviour: `specrt.runtime.serving.server`; batching: `specrt.runtime.serving.batcher`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from specrt.plugins.errors import SpecrtError

# The flags live here, not in specrt.runtime.serving: `specrt --help` builds every subcommand's
# parser, and this module must not pull in the serving package (or FastAPI) to do that.


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """generate's model and drafting flags (no trt backend: the batcher's row views are untested there)."""
    from specrt.tools.cli_generate import add_model_arguments as shared

    shared(p, backends=("auto", "ort", "torch"))


def add_shared_batches_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shared-batches", action="store_true",
                   help="int4/int8/w8a8 engines: run batches through the portable batched graph (one call for "
                        "all requests: more throughput at several requests) instead of one fused call per "
                        "request; a request's text can then differ from its text alone (docs/exactness.md)")


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    add_shared_batches_argument(p)
    p.add_argument("--slots", type=int, default=8, help="KV rows: requests decoded together (default 8)")
    p.add_argument("--capacity", type=int, default=1024, help="KV slots per row: prompt + completion (default 1024)")
    p.add_argument("--schedule", default="confidence", choices=["fixed", "confidence"],
                   help="verify lengths: fixed (as drafted) or confidence (DSpark Algorithm 1 with SPS(B))")
    p.add_argument("--sps", help="SPS table (sps.json from `specrt calibrate`; default: the engine folder's)")
    p.add_argument("--no-draft-gate", action="store_true",
                   help="confidence schedule: always draft, even when drafting has not paid recently")
    p.add_argument("--no-measured-gate", action="store_true",
                   help="confidence schedule: speculate even where speculative steps measured slower than plain ones")


def check_batch_arguments(args: argparse.Namespace) -> None:
    if args.slots < 1 or args.slots > 256:
        raise SpecrtError(f"--slots must be in 1..256, got {args.slots}", "pass --slots 8 (requests decoded together)")
    if args.capacity < 16:
        raise SpecrtError(f"--capacity {args.capacity} is too small", "pass --capacity 1024 or more")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_batch_arguments(p)
    s = p.add_argument_group("HTTP")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", help="model id served besides `default` (default: the engine's name)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    s.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request before 504")
    s.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    add_exposure_arguments(s)
    add_ray_arguments(p)


def add_exposure_arguments(s) -> None:
    """Flags for a server others can reach (docs/serving-security.md)."""
    s.add_argument("--api-key",  # the environment is read in run(): a default here would print the key in --help
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $SPECRT_API_KEY; "
                        "the environment keeps the key out of the process list)")
    s.add_argument("--max-request-bytes", type=int,
                   help="largest request body, refused with 413 before it is read (default: sized to the context, "
                        "64 KiB + 32 bytes per context token)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's headers, and then its body, may take to arrive (default 30)")
    s.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM: seconds running requests may finish before streams are cut with an error "
                        "(default 30)")


def check_exposure_arguments(args: argparse.Namespace) -> None:
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise SpecrtError(f"--max-request-bytes {args.max_request_bytes} is too small for any request",
                          "pass 1024 or more, or drop it to size the limit to the context")
    if args.read_timeout <= 0 or args.drain_seconds < 0:
        raise SpecrtError("--read-timeout must be positive and --drain-seconds >= 0",
                          "e.g. --read-timeout 30 --drain-seconds 30")


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("Ray Serve (docs/ray.md)")
    r.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve: engine replicas behind the same OpenAI routes (pip install 'specrt[ray]')")
    scale = r.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, help="--ray: engine replicas (default 1)")
    scale.add_argument("--autoscale", metavar="MIN,MAX", help="--ray: scale replicas on ongoing requests")
    r.add_argument("--ray-address", metavar="ADDR",
                   help="--ray: join this cluster (auto, or HEAD_IP:6379); default: start a local one-node cluster")


def run(args: argparse.Namespace) -> int:
    from specrt.tools.cli_generate import resolve_backend
    from specrt.runtime.serving.loading import make_batcher, make_engine, sps_for

    check_batch_arguments(args)
    resolve_backend(args)
    if args.max_queue < 1 or args.request_timeout <= 0 or args.default_max_tokens < 1:
        raise SpecrtError("--max-queue, --request-timeout and --default-max-tokens must be positive",
                          "e.g. --max-queue 64 --request-timeout 300 --default-max-tokens 256")
    check_exposure_arguments(args)
    args.api_key = args.api_key or os.environ.get("SPECRT_API_KEY") or None
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise SpecrtError(f"the server needs {exc.name}", "pip install 'specrt[serve]'") from None
    from specrt.tools.cli_serve_ray import ray_requested, run_ray

    if ray_requested(args):
        return run_ray(args)
    from specrt.runtime.serving.loop import EngineLoop
    from specrt.runtime.serving.server import ServeConfig, create_app

    start = time.perf_counter()
    from specrt.tools.cli_generate import load_pipeline

    pipe = load_pipeline(args)
    engine = make_engine(pipe, args.slots, args.capacity)
    sps = sps_for(pipe, engine, args)
    batcher = make_batcher(pipe, engine, args.schedule, sps, draft_gate=not args.no_draft_gate,
                           measured_gate=not args.no_measured_gate)
    loop = EngineLoop(batcher, max_queue=args.max_queue).start()
    name = args.model_name or pipe.name
    config = ServeConfig(name, args.default_max_tokens, args.request_timeout, args.max_request_bytes,
                         args.read_timeout, args.drain_seconds, args.api_key)
    app = create_app(loop, pipe.tokenizer, config)
    drafter = pipe.proposer.name if pipe.proposer is not None else "none (plain decoding)"
    print(f"loaded {pipe.name} ({pipe.backend}) in {time.perf_counter() - start:.1f}s | drafter {drafter} | "
          f"schedule {batcher.schedule} | {batcher.slots} slots x {batcher.capacity} tokens", file=sys.stderr)
    print(f"serving '{name}' and 'default' on http://{args.host}:{args.port}/v1", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print("warning: listening beyond this machine without --api-key (docs/serving-security.md)", file=sys.stderr)
    from specrt.runtime.serving.http_server import make_server

    try:  # SIGTERM / Ctrl-C: stop accepting, drain for --drain-seconds, then exit
        make_server(app, args.host, args.port, header_timeout=args.read_timeout, drain_seconds=args.drain_seconds).run()
    finally:
        loop.stop()
    return 0
