"""`specrt generate`: load a target, apply its chat template, stream the answer, print the stats line.

    specrt generate --backend torch --prompt "Why is the sky blue?" --max-new-tokens 128

The text goes to stdout as it is produced; the stats line (`tau 1.00 | 41.2 tok/s | 128 tokens`)
and load messages go to stderr, so `specrt generate ... > answer.txt` captures the text alone.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="user message (default: read stdin)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--backend", default="torch", choices=["torch"], help="engine backend (ort and trt arrive with their issues)")
    p.add_argument("--target", help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="weight dtype for the torch backend")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--capacity", type=int, default=None, help="KV cache slots (default: prompt + max-new-tokens + margin)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    d = p.add_argument_group("speculative decoding")
    d.add_argument("--drafter", default="none", choices=["none", "eagle3", "dflash", "dspark"])
    d.add_argument("--drafter-ckpt", help="drafter folder (config.json + model.safetensors, official format)")
    d.add_argument("--tree-top-k", type=int, default=4, help="EAGLE-3: children per node and frontier width")
    d.add_argument("--tree-depth", type=int, default=5, help="EAGLE-3: deepest draft position")
    d.add_argument("--tree-tokens", type=int, default=16, help="EAGLE-3: verify tokens per step (anchor included)")
    d.add_argument("--speedup", action="store_true",
                   help="afterwards, time plain decoding of the same prompt and print the speedup")
    d.add_argument("--confidence-threshold", type=float, default=0.1,
                   help="DSpark: verify drafts while their survival probability stays above this")


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def run(args: argparse.Namespace) -> int:
    from specrt.export.checkpoints import load_target
    from specrt.export.errors import SpecrtError
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.generate import generate_autoregressive
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.stats import summary_line
    from specrt.runtime.streaming import TextStream

    from specrt.runtime.proposers.factory import DraftOptions, load_proposer
    from specrt.runtime.speculative import generate_speculative

    # validate everything cheap before loading anything
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    options = DraftOptions(args.tree_top_k, args.tree_depth, args.tree_tokens, args.confidence_threshold)
    if args.max_new_tokens < 1:
        raise SpecrtError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}", "ask for at least one token")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    target = load_target(args.target, DTYPES[args.dtype])
    model = target.model.to(args.device)
    print(f"loaded {target.name} from {target.source} in {target.load_seconds:.1f}s", file=sys.stderr)
    tok = target.tokenizer
    ids = tok.encode(prompt) if args.no_chat_template else tok.encode_chat(prompt, args.system)
    proposer = None
    if args.drafter != "none":
        # the shipped drafters belong to the embedded default only
        shipped_for = target.name if args.target is None else None
        proposer = load_proposer(args.drafter, args.drafter_ckpt, model, options, shipped_for)
        print(f"drafter: {args.drafter} ({args.drafter_ckpt or 'shipped'})", file=sys.stderr)
    capacity = args.capacity or min(model.config.max_position_embeddings, len(ids) + args.max_new_tokens + 64)
    spare = 64 if proposer is None else max(64, proposer.max_drafts + 1)
    engine = TorchTargetEngine(model, capacity, spare_slots=spare)
    stream = TextStream(tok, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    start = time.perf_counter()
    common = dict(eos_token_ids=model.config.eos_token_ids, on_tokens=lambda row, new: stream.push(new))
    if proposer is None:
        result = generate_autoregressive(engine, [ids], args.max_new_tokens, sampling, **common)
    else:
        result = generate_speculative(engine, proposer, [ids], args.max_new_tokens, sampling, **common)
    stream.close()
    wall = time.perf_counter() - start
    sys.stdout.write("\n")
    print(summary_line(result.stats, wall), file=sys.stderr)
    if args.speedup and proposer is not None:
        start = time.perf_counter()
        plain = generate_autoregressive(engine, [ids], args.max_new_tokens, sampling, model.config.eos_token_ids)
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
