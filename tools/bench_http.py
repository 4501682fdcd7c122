"""`specrt bench-serving --url`: throughput and latency of any OpenAI-compatible endpoint.

    specrt bench-serving --url http://127.0.0.1:8000 --concurrency 1,4,16 --label "specrt serve"
    specrt bench-serving --url http://head:8000 --concurrency 1,4,16 --label "ray 2x1" --out docs/ray

The same command measures one `specrt serve` process, `specrt serve --ray` with any number of
replicas, or another server, so their numbers compare. For every concurrency c, c closed-loop
clients (a finished request is replaced at once) send streaming chat completions of MT-bench first
turns (or `--prompts synthetic`: random words) with `max_tokens = --max-new-tokens`; the tokens of a
request are the `usage.completion_tokens` the server reports. Measured per level: throughput
(completion tokens / wall time of the level), request latency (send -> last byte) p50 and p95, time
to first token p50, and failed requests. Writes http.json, http.md and http.png to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

from specrt.plugins.errors import SpecrtError


def prompts_for(args: argparse.Namespace, count: int) -> list[list[dict]]:
    if args.prompts == "mtbench":
        from specrt.tools.datasets import mtbench_questions

        questions = mtbench_questions()
        return [[{"role": "user", "content": questions[i % len(questions)]["turns"][0]}] for i in range(count)]
    rng = random.Random(args.seed)
    words = ["the", "a", "model", "serves", "tokens", "fast", "and", "every", "request", "waits", "for", "rows"]
    return [[{"role": "user", "content": " ".join(rng.choice(words) for _ in range(args.prompt_len))}]
            for _ in range(count)]


def one_request(base: str, model: str, messages: list[dict], args) -> dict:
    """One streaming chat completion over http.client (standard library: nothing to install)."""
    import http.client
    from urllib.parse import urlsplit

    body = {"model": model, "messages": messages, "max_tokens": args.max_new_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    where = urlsplit(base)
    conn_type = http.client.HTTPSConnection if where.scheme == "https" else http.client.HTTPConnection
    start = time.perf_counter()
    first, tokens, error = None, 0, None
    conn = conn_type(where.netloc, timeout=args.timeout)
    try:
        conn.request("POST", where.path + "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            error = f"HTTP {response.status}: {response.read()[:200]!r}"
        else:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"].get("message", "error")
                    break
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            else:
                error = error or "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    end = time.perf_counter()
    return {"latency": end - start, "ttft": (first or end) - start, "tokens": tokens, "error": error}


def closed_loop(base: str, model: str, prompts: list[list[dict]], concurrency: int, args) -> tuple[list, float]:
    """`concurrency` client threads, each sending its next prompt as soon as its last answer is complete."""
    pending = list(prompts)
    results: list[dict] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                messages = pending.pop(0)
            results.append(one_request(base, model, messages, args))

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    from specrt.tools.bench_serving import percentile as shared

    return shared(values, q)


def measure_level(base: str, model: str, concurrency: int, args) -> dict:
    count = args.requests or max(4, 2 * concurrency)
    results, seconds = closed_loop(base, model, prompts_for(args, count), concurrency, args)
    ok = [r for r in results if r["error"] is None]
    latency = [r["latency"] for r in ok]
    errors = [r["error"] for r in results if r["error"] is not None]
    row = {"label": args.label, "concurrency": concurrency, "requests": count, "failed": len(errors),
           "tokens": sum(r["tokens"] for r in ok), "seconds": seconds,
           "tok_s": sum(r["tokens"] for r in ok) / seconds if seconds > 0 else 0.0,
           "req_s": len(ok) / seconds if seconds > 0 else 0.0,
           "latency_p50": percentile(latency, 0.5), "latency_p95": percentile(latency, 0.95),
           "ttft_p50": percentile([r["ttft"] for r in ok], 0.5),
           "first_error": errors[0] if errors else None}
    print(f"c={concurrency:3d} {row['tok_s']:8.1f} tok/s  p50 {row['latency_p50']:.2f}s  p95 {row['latency_p95']:.2f}s"
          f"  TTFT p50 {row['ttft_p50']:.3f}s  failed {len(errors)}", file=sys.stderr)
    return row


def run_url(args: argparse.Namespace) -> int:
    from specrt.tools.report_files import write_report

    if args.engines or args.drafters:
        raise SpecrtError("--url measures a running server; --engines/--drafters load one in-process",
                          "pass either --url or engine flags")
    if args.max_new_tokens < 1:
        raise SpecrtError("--max-new-tokens must be >= 1", "e.g. --max-new-tokens 128")
    base = args.url.rstrip("/")
    base = base.removesuffix("/v1")
    levels = parse_list(args.concurrency, "concurrency")
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            models = json.loads(r.read())["data"]
    except (OSError, ValueError, KeyError) as exc:
        raise SpecrtError(f"no OpenAI endpoint answers at {base}/v1/models ({exc})",
                          "start the server first (specrt serve ...) and pass its address") from None
    model = args.model or models[0]["id"]
    closed_loop(base, model, prompts_for(args, 1), 1, args)  # warm-up: first calls allocate
    rows = [measure_level(base, model, c, args) for c in levels]
    report = {"url": base, "label": args.label, "model": model, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "prompts": args.prompts, "ignore_eos": args.ignore_eos,
              "results": rows}
    write_report(args.out, "http", report, render_markdown(report), plot)
    return 0


def render_markdown(report: dict) -> str:
    lines = [f"## {report['label']}: {report['url']} ({report['model']})", "",
             (f"{report['max_new_tokens']} new tokens per request, temperature {report['temperature']}, "
              f"{report['prompts']} prompts, streaming chat completions, closed-loop clients."), "",
             "| concurrency | requests | failed | tok/s | req/s | latency p50 s | latency p95 s | TTFT p50 s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['failed']} | {r['tok_s']:.1f} | {r['req_s']:.2f} | "
                     f"{r['latency_p50']:.2f} | {r['latency_p95']:.2f} | {r['ttft_p50']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["results"], key=lambda r: r["concurrency"])
    xs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(xs, [r["tok_s"] for r in rows], marker="o")
    ax2.plot(xs, [r["latency_p50"] for r in rows], marker="o", label="p50")
    ax2.plot(xs, [r["latency_p95"] for r in rows], marker="o", label="p95")
    for ax, ylabel in ((ax1, "throughput (tokens/s)"), (ax2, "request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax2.legend()
    fig.suptitle(f"{report['label']} ({report['url']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_list(text: str, name: str) -> list[int]:
    from specrt.plugins.errors import SpecrtError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecrtError(f"--{name} must be a comma list of integers, got {text!r}", f"e.g. --{name} 1,2,4,8,16") from None
    if not values or any(v < 1 for v in values):
        raise SpecrtError(f"--{name} needs positive integers, got {text!r}", f"e.g. --{name} 1,2,4,8,16")
    return values
