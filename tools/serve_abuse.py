"""Load and fault run against a real `specrt serve` process: does anything freeze, leak or 500?

    python -m specrt.tools.serve_abuse --engines engines/smollm2-int4 [--slots 8] [--streams 32]
           [--waves 2] [--disconnects 20] [--huge-mb 20] [--drain-seconds 5] [--out runs/serve-abuse]

Stages, in order, against one server started here (`specrt serve --engines ...`):
  1. waves     --waves x --streams concurrent chat streams from the official openai client; every
               stream must end with a finish reason, and afterwards every row is free;
  2. disconnects  --disconnects clients go away mid-answer (streams closed after a few chunks, and
               non-streaming requests whose client times out); their rows must be free at once;
  3. huge      a --huge-mb MB prompt sent whole while a stream runs: answered 413 (or the connection
               closed under it), and the running stream's largest gap between chunks is reported;
  4. RSS       the server's resident memory after all that against its value after warm-up;
  5. SIGTERM   streams in flight, then SIGTERM: each must end with an error event the openai client
               raises or with its finish reason, a request sent after it is refused, and the process
               exits within --drain-seconds plus a margin.
Checks: no HTTP 500 anywhere, no request past its deadline (a hang), no leaked row, RSS back within
10% of its start. The result goes to OUT/serve_abuse.json and a summary to stdout; the exit status
is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HANG_S = 300.0  # a request still unanswered after this is a hang


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        import openai

        self.args, self.openai = args, openai
        self.port = args.port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        self.report: dict = {"engines": args.engines, "slots": args.slots, "checks": {}}
        self.statuses: list[int] = []  # every HTTP error status a client saw
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ server
    def start(self) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "specrt.tools.cli", "serve", "--engines", a.engines, "--port", str(self.port),
               "--slots", str(a.slots), "--drain-seconds", str(a.drain_seconds), *a.serve_args]
        self.report["command"] = " ".join(cmd)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(Path(a.out) / "server.log", "w"))
        end = time.monotonic() + 600
        while True:
            try:
                get_json(self.base, "/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"the server did not come up (see {Path(a.out) / 'server.log'})")
                time.sleep(0.5)

    def rows(self) -> dict:
        """Wait (briefly) for the rows to come back; the last /health."""
        end = time.monotonic() + 5.0
        while True:
            h = get_json(self.base, "/health")
            if (h["free_slots"] == h["slots"] and h["running"] == 0 and h["queue_depth"] == 0) or time.monotonic() > end:
                return h

    def leaked(self) -> int:
        h = self.rows()
        return h["slots"] - h["free_slots"] + h["queue_depth"]

    # ------------------------------------------------------------------ clients
    def stream(self, prompt: str, max_tokens: int, out: dict, stop_after: int | None = None) -> None:
        """One chat stream; out gets chunk times, the finish reason or the error."""
        out["times"], out["finish"] = [], None
        start = time.monotonic()
        try:
            s = self.client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=0, stream=True)
            for chunk in s:
                out["times"].append(time.monotonic())
                if chunk.choices and chunk.choices[0].finish_reason:
                    out["finish"] = chunk.choices[0].finish_reason
                if stop_after is not None and len(out["times"]) >= stop_after:
                    s.close()  # the client goes away mid-answer
                    out["finish"] = "closed by client"
                    break
        except self.openai.APIStatusError as exc:
            self.statuses.append(exc.status_code)
            out["error"] = f"{exc.status_code}: {exc.message}"
        except Exception as exc:  # noqa: BLE001 - reported
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - start

    def threads(self, target, kwargs_list: list[dict]) -> list[dict]:
        outs = [{} for _ in kwargs_list]
        ts = [threading.Thread(target=target, kwargs={**kw, "out": o}, daemon=True) for kw, o in zip(kwargs_list, outs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(HANG_S)
        for o, t in zip(outs, ts):
            if t.is_alive():
                o["error"] = "hang"
        return outs

    # ------------------------------------------------------------------ stages
    def waves(self) -> None:
        a = self.args
        prompts = [f"Write a short note number {i} about the weather in a city you like." for i in range(a.streams)]
        waves = []
        for w in range(a.waves):
            start = time.monotonic()
            outs = self.threads(self.stream, [{"prompt": p, "max_tokens": a.max_tokens} for p in prompts])
            done = sum(o.get("finish") in ("stop", "length") for o in outs)
            waves.append({"streams": len(outs), "finished": done, "errors": [o["error"] for o in outs if "error" in o],
                          "seconds": round(time.monotonic() - start, 1), "leaked_rows": self.leaked()})
        self.report["waves"] = waves
        self.check("waves: every stream finished", all(w["finished"] == w["streams"] for w in waves))
        self.check("waves: no leaked row", all(w["leaked_rows"] == 0 for w in waves))

    def non_streaming_timeout(self, prompt: str, out: dict) -> None:
        import openai

        quick = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=1.0)
        try:
            quick.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=self.args.capacity_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            out["finish"] = "answered"
        except openai.APITimeoutError:
            out["finish"] = "closed by client"
        except openai.APIStatusError as exc:
            self.statuses.append(exc.status_code)
            out["error"] = f"{exc.status_code}: {exc.message}"

    def disconnects(self) -> None:
        n = self.args.disconnects
        half = n // 2
        before = get_json(self.base, "/metrics")["finish_reasons"].get("cancelled", 0)
        streams = self.threads(self.stream, [{"prompt": f"Tell me a long story, part {i}.", "max_tokens": 200,
                                              "stop_after": 3} for i in range(half)])
        waits = self.threads(self.non_streaming_timeout, [{"prompt": f"Explain everything about topic {i}."}
                                                          for i in range(n - half)])
        t0 = time.monotonic()
        leaked = self.leaked()
        freed_s = time.monotonic() - t0
        cancelled = get_json(self.base, "/metrics")["finish_reasons"].get("cancelled", 0) - before
        self.report["disconnects"] = {"clients": n, "closed": sum(o.get("finish") == "closed by client"
                                                                  for o in streams + waits),
                                      "cancelled_on_server": cancelled, "leaked_rows": leaked,
                                      "seconds_to_free_rows": round(freed_s, 2),
                                      "errors": [o["error"] for o in streams + waits if "error" in o]}
        self.check("disconnects: rows freed", leaked == 0)

    def huge(self) -> None:
        a = self.args
        body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hello " * (a.huge_mb * 2**20 // 6)}],
                           "max_tokens": 8}).encode()
        running: dict = {}
        t = threading.Thread(target=self.stream, kwargs={"prompt": "Count from one to fifty in words.",
                                                          "max_tokens": 96, "out": running}, daemon=True)
        t.start()
        end = time.monotonic() + 120
        while len(running.get("times", [])) < 3 and time.monotonic() < end and "error" not in running:
            time.sleep(0.05)
        start = time.monotonic()
        status = None
        try:
            req = urllib.request.Request(self.base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                status = r.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError as exc:  # the server closed the connection under the upload after answering
            status = f"connection closed ({type(exc).__name__})"
        answered_s = time.monotonic() - start
        t.join(HANG_S)
        times = running.get("times", [])
        gaps = [b - a for a, b in zip(times, times[1:])]
        self.report["huge_prompt"] = {"megabytes": len(body) / 2**20, "status": status,
                                      "answered_seconds": round(answered_s, 2),
                                      "stream_max_gap_seconds": round(max(gaps), 3) if gaps else None,
                                      "stream_finish": running.get("finish"), "stream_error": running.get("error")}
        if isinstance(status, int) and status >= 500:
            self.statuses.append(status)
        self.check("huge prompt: refused without a 500", status == 413 or isinstance(status, str))
        self.check("huge prompt: the stream beside it never stalled 1 s", bool(gaps) and max(gaps) < 1.0)

    def sigterm(self) -> None:
        a = self.args
        outs = [{} for _ in range(4)]
        ts = [threading.Thread(target=self.stream, kwargs={"prompt": f"Write a long essay, part {i}.",
                                                            "max_tokens": a.capacity_tokens, "out": o}, daemon=True)
              for i, o in enumerate(outs)]
        for t in ts:
            t.start()
        end = time.monotonic() + 120
        while not all(len(o.get("times", [])) >= 2 for o in outs) and time.monotonic() < end:
            time.sleep(0.05)
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        after: dict = {}
        self.stream("Are you there?", 4, after)
        for t in ts:
            t.join(a.drain_seconds + 60)
        try:
            code = self.proc.wait(a.drain_seconds + 30)
        except subprocess.TimeoutExpired:
            code = "still running"
        exit_s = time.monotonic() - sent
        ended = [o.get("finish") or o.get("error", "no end") for o in outs]
        self.report["sigterm"] = {"streams": ended, "request_after_sigterm": after.get("error") or after.get("finish"),
                                  "exit_code": code, "exit_seconds": round(exit_s, 1)}
        ok_end = all(o.get("finish") in ("stop", "length") or "shut down" in o.get("error", "") for o in outs)
        self.check("SIGTERM: each stream ended with its finish reason or an error event", ok_end)
        self.check("SIGTERM: exited within the drain", code != "still running" and exit_s < a.drain_seconds + 30)
        self.statuses = [s for s in self.statuses if s != 503]  # shutdown refusals are the intended answer

    def check(self, name: str, ok: bool) -> None:
        self.report["checks"][name] = bool(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)

    def run(self) -> int:
        Path(self.args.out).mkdir(parents=True, exist_ok=True)
        self.start()
        try:
            warm: dict = {}
            self.stream("Hello!", 8, warm)
            start_rss = rss_mb(self.proc.pid)
            self.waves()
            self.disconnects()
            self.huge()
            time.sleep(2.0)
            end_rss = rss_mb(self.proc.pid)
            self.report["rss_mb"] = {"after_warmup": round(start_rss, 1), "after_abuse": round(end_rss, 1),
                                     "ratio": round(end_rss / start_rss, 3)}
            self.check("RSS back within 10% of its start", end_rss <= 1.10 * start_rss)
            self.sigterm()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.report["http_5xx"] = sorted(s for s in self.statuses if s >= 500)
        self.check("no HTTP 500", not self.report["http_5xx"])
        self.check("no hang", "hang" not in json.dumps(self.report))
        path = Path(self.args.out) / "serve_abuse.json"
        path.write_text(json.dumps(self.report, indent=2) + "\n")
        print(json.dumps({k: v for k, v in self.report.items() if k != "checks"}, indent=1))
        print(f"wrote {path}")
        return 0 if all(self.report["checks"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specrt.tools.serve_abuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", required=True, help="engine folder to serve")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--port", type=int, help="default: a free port")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams per wave")
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per wave stream")
    p.add_argument("--disconnects", type=int, default=20)
    p.add_argument("--huge-mb", type=int, default=20)
    p.add_argument("--drain-seconds", type=float, default=5.0)
    p.add_argument("--capacity-tokens", type=int, default=512, help="max_tokens of the long requests")
    p.add_argument("--out", default="runs/serve-abuse")
    p.add_argument("serve_args", nargs="*", help="more `specrt serve` flags (after --)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return Run(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
