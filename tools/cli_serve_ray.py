"""`specrt serve --ray`: the same OpenAI server, its engine in Ray Serve replicas (docs/ray.md).

    specrt serve --engines engines/NAME --ray --replicas 2              (starts a local one-node cluster)
    specrt serve --engines engines/NAME --ray --autoscale 1,4 --ray-address auto   (joins `ray start --head`)

The flags live in cli_serve.py; this module checks them, builds the application
(`specrt.runtime.serving.ray_app`) and keeps it up until Ctrl-C. Each replica loads its pipeline with
`cli_generate.load_pipeline(args)` on its own node: the engine folder's path must exist there.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import signal
import sys
import time

from specrt.plugins.errors import SpecrtError

DEFAULT_REPLICA_THREADS = 1  # one replica per core: replicas, not threads, are what Ray spreads over machines


def ray_requested(args: argparse.Namespace) -> bool:
    """True with --ray; Ray-only flags without it are an error (they would be ignored)."""
    given = [flag for flag in ("--replicas", "--autoscale", "--ray-address")
             if getattr(args, flag[2:].replace("-", "_"), None) is not None]
    if given and not getattr(args, "ray", False):
        raise SpecrtError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to Ray Serve",
                          "add --ray, or drop them")
    return bool(getattr(args, "ray", False))


def parse_autoscale(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise SpecrtError(f"--autoscale takes MIN,MAX replicas, got {text!r}", "e.g. --autoscale 1,4") from None
    if not 1 <= low <= high:
        # MIN 0 (scale to zero) is refused: the ingress needs a replica to describe the engine before it serves
        raise SpecrtError(f"--autoscale {text}: need 1 <= MIN <= MAX", "e.g. --autoscale 1,4")
    return low, high


def settings_from(args: argparse.Namespace):
    from specrt.runtime.serving.ray_app import IngressSettings, ReplicaSettings, Scaling
    from specrt.tools.cli_generate import resolve_backend

    if resolve_backend(args) != "ort":
        raise SpecrtError("--ray serves engine folders (ONNX Runtime)", "pass --engines engines/NAME")
    if args.replicas is not None and args.replicas < 1:
        raise SpecrtError(f"--replicas must be >= 1, got {args.replicas}", "e.g. --replicas 2")
    args.threads = args.threads or DEFAULT_REPLICA_THREADS
    replica = ReplicaSettings(slots=args.slots, capacity=args.capacity, schedule=args.schedule, sps=args.sps,
                              engines=args.engines, draft_gate=not args.no_draft_gate,
                              measured_gate=not args.no_measured_gate, threads=args.threads)
    ingress = IngressSettings(args.model_name, args.max_queue, server_options(args))
    scaling = Scaling(args.replicas or 1, parse_autoscale(args.autoscale) if args.autoscale else None)
    return replica, ingress, scaling


def server_options(args: argparse.Namespace) -> dict:
    """The `ServeConfig` fields `specrt serve` has flags for (same names: --request-timeout -> request_timeout),
    so the Ray ingress runs the HTTP server exactly as configured for one process."""
    from specrt.runtime.serving.server import ServeConfig

    names = {f.name for f in dataclasses.fields(ServeConfig)} - {"model_name"}
    return {name: getattr(args, name) for name in sorted(names) if getattr(args, name, None) is not None}


def stop_serving(signum, frame) -> None:
    raise KeyboardInterrupt


def run_ray(args: argparse.Namespace) -> int:
    from specrt.tools.cli_generate import load_pipeline

    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecrtError("--ray needs Ray Serve", "pip install 'specrt[ray]'") from None
    from specrt.runtime.serving import ray_app

    replica, ingress, scaling = settings_from(args)
    start = time.perf_counter()
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning")
    own_cluster = args.ray_address is None
    try:
        app = ray_app.build_app(functools.partial(load_pipeline, args), replica, ingress, scaling)
        ray_app.deploy(app, args.host, args.port)
        replicas = ray_app.wait_healthy()
        count = (f"{scaling.autoscale[0]}..{scaling.autoscale[1]} replicas (autoscaled)" if scaling.autoscale
                 else f"{replicas.get('EngineReplica', 0)} replica(s)")
        print(f"Ray Serve up in {time.perf_counter() - start:.1f}s: {count} x {replica.threads} thread(s), "
              f"{replica.slots} slots x {replica.capacity} tokens each", file=sys.stderr)
        print(f"serving on http://{args.host}:{args.port}/v1 (Ctrl-C stops it)", file=sys.stderr)
        # SIGTERM (systemd, docker, kubernetes) and SIGINT stop it cleanly; set explicitly, because a shell
        # starts background jobs with SIGINT ignored and Python then never raises KeyboardInterrupt
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop_serving)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        if own_cluster:
            serve.shutdown()
            ray.shutdown()
        else:  # a shared cluster keeps running; only this application goes
            serve.delete(ray_app.APP_NAME)
