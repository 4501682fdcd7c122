"""Plain decoding speed: specrt's torch backend against transformers' generate, in one run.

    python tools/bench_ar.py [--tokens 128] [--repeats 3]

Both run greedy on the same prompt, same weights (the embedded default, dequantized to fp32), same
thread count; the order alternates across repeats so drift on a shared machine hits both. Also
reports the load time of the default model. transformers is only needed for the comparison
(`pip install -e '.[test]'`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from specrt.export.checkpoints import load_target
    from specrt.export.default_model import find_default_gguf
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.generate import generate_autoregressive
    from specrt.runtime.sampling import SamplingParams

    target = load_target()
    ids = target.tokenizer.encode_chat(PROMPT)
    path = find_default_gguf()
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_load = time.perf_counter() - t0
    engine = TorchTargetEngine(target.model, len(ids) + args.tokens + 8)

    def ours() -> float:
        start = time.perf_counter()
        out = generate_autoregressive(engine, [ids], args.tokens, SamplingParams(), eos_token_ids=())
        assert len(out.tokens[0]) == args.tokens
        return args.tokens / (time.perf_counter() - start)

    def theirs() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=2)
        assert out.shape[1] - len(ids) == args.tokens
        return args.tokens / (time.perf_counter() - start)

    ours(), theirs()  # warm-up
    rates: dict[str, list[float]] = {"specrt torch": [], "transformers generate": []}
    for r in range(args.repeats):
        order = [("specrt torch", ours), ("transformers generate", theirs)]
        for name, fn in order if r % 2 == 0 else reversed(order):
            rates[name].append(fn())
    print(f"threads: {torch.get_num_threads()}, prompt tokens: {len(ids)}, new tokens: {args.tokens}, greedy fp32")
    print(f"load time of the default model: specrt {target.load_seconds:.1f}s, transformers {hf_load:.1f}s")
    print("| engine | tok/s (median) | runs |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    ratio = statistics.median(rates["specrt torch"]) / statistics.median(rates["transformers generate"])
    print(f"specrt / transformers: {ratio:.2f}x")


if __name__ == "__main__":
    main()
