"""The peers `specrt bench --compare` runs beside specrt: llama.cpp, ONNX Runtime GenAI, and specrt's
own torch backend (plain decoding; so the ORT backend is compared with it in the same run).

Each peer gets the same model weights, the same prompt token ids, the same thread count and the same
max-new-tokens, and is timed the way specrt is (prefill + decode of one request, batch 1). Greedy at
temperature 0; at a temperature > 0 each samples from the whole distribution with its own random
generator, seeded with the number given (`generate(prompt, max_new, temperature, seed)`):

- llama.cpp (`llama-cpp-python`) on the same GGUF file specrt loads (the embedded default is Q4_1:
  llama.cpp computes on the 4-bit weights, specrt on the dequantized fp32 ones);
- onnxruntime-genai on models its own builder (`onnxruntime_genai.models.builder`) made from the
  same weights, int4 (RTN, block 32; `ort-genai`) and fp32 (`ort-genai-fp32`). The builder reads a Hugging Face folder, so the
  target is first written as one (`write_hf_folder`: config.json, model.safetensors, tokenizer).
  Built models are cached under ~/.cache/specrt/peers/<target name>/.

Sampling settings: onnxruntime-genai `do_sample` with top_k 0 and top_p 1 (top_k 0 sends it down its
nucleus path, which at p = 1 keeps every token; its config's default top_k is 50, so both are set) and
`random_seed`; llama.cpp temp T with top_k 0, top_p 1, min_p 0, typical_p 1 (each filter off) and
`set_seed` before the request (its sampler chain is built per `generate` call from that seed).

A peer that is not installed is reported as missing with the pip command that installs it; the
bench goes on with the rest. So is a llama.cpp that crashes: `pip install llama-cpp-python` compiles
llama.cpp for the CPU it runs on, AMX kernels included where the CPU reports AMX, and a virtual
machine that does not grant AMX state kills the process with a segmentation fault at the first
decode. A short decode in a child process (`llamacpp_smoke`) finds that before the bench loads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

PEERS = ("torch", "llama.cpp", "ort-genai", "ort-genai-fp32")  # ort-genai: its int4 build
INSTALL = {"llama.cpp": "pip install llama-cpp-python", "ort-genai": "pip install onnxruntime-genai"}
# llama.cpp built without AMX (and without -march=native), for machines where the native build crashes
LLAMACPP_PORTABLE = ("CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                     "-DGGML_AVX512_VNNI=ON\" pip install --force-reinstall --no-deps --no-binary llama-cpp-python "
                     "--no-cache-dir llama-cpp-python")
_LLAMACPP_SMOKE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=64, verbose=False)
llm.eval([llm.token_bos(), 1, 2, 3])
"""


@dataclass
class PeerRun:
    name: str
    # (prompt ids, max new tokens, temperature, seed or None) -> new tokens made
    generate: Callable[[Sequence[int], int, float, int | None], int] | None
    note: str = ""


def peers_cache(target_name: str) -> Path:
    root = Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt"))
    return root / "peers" / target_name


def write_hf_folder(loaded_target, folder: Path) -> Path:
    """The loaded target as a Hugging Face Llama folder (fp32 safetensors + tokenizer files)."""
    from safetensors.torch import save_file

    model, cfg = loaded_target.model, loaded_target.model.config
    folder.mkdir(parents=True, exist_ok=True)
    tied = cfg.tie_word_embeddings
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": tied,
        "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    }
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "do_sample": False}))
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("lm_head") and tied:
            continue
        key = name if name.startswith("lm_head") else f"model.{name}"
        state[key] = tensor.detach().float().contiguous().clone()
    save_file(state, str(folder / "model.safetensors"))
    loaded_target.tokenizer.save(folder)
    return folder


def build_genai_model(loaded_target, precision: str, threads: int, progress=print) -> Path:
    """onnxruntime-genai's own build of the target (cached), with its session threads set."""
    root = peers_cache(loaded_target.name)
    out = root / f"ort-genai-{precision}"
    if not (out / "genai_config.json").is_file():
        hf = root / "hf"
        if not (hf / "model.safetensors").is_file():
            progress(f"writing {loaded_target.name} as a Hugging Face folder for the genai builder -> {hf}")
            write_hf_folder(loaded_target, hf)
        progress(f"building the onnxruntime-genai {precision} model (its builder, once) -> {out}")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(root / "builder-cache")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not (out / "genai_config.json").is_file():
            raise RuntimeError(f"the genai builder failed: {done.stderr.strip().splitlines()[-1:]} ({' '.join(cmd)})")
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    session = config["model"]["decoder"].setdefault("session_options", {})
    session["intra_op_num_threads"] = int(threads)
    session["inter_op_num_threads"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return out


def genai_peer(loaded_target, precision: str, threads: int, progress=print) -> PeerRun:
    name = f"ort-genai {precision}"
    try:
        import onnxruntime_genai as og
    except ImportError:
        return PeerRun(name, None, f"not installed ({INSTALL['ort-genai']})")
    try:
        folder = build_genai_model(loaded_target, precision, threads, progress)
    except RuntimeError as err:
        return PeerRun(name, None, str(err))
    model = og.Model(str(folder))

    def generate(prompt: Sequence[int], max_new: int, temperature: float = 0.0, seed: int | None = None) -> int:
        params = og.GeneratorParams(model)
        search = {"do_sample": False}
        if temperature > 0:  # the whole distribution (module docstring)
            search = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": temperature}
            if seed is not None:
                search["random_seed"] = seed
        params.set_search_options(max_length=len(prompt) + max_new, batch_size=1, **search)
        generator = og.Generator(model, params)
        generator.append_tokens(list(prompt))
        made = 0
        while not generator.is_done() and made < max_new:
            generator.generate_next_token()
            made += 1
        return made

    return PeerRun(name, generate, f"onnxruntime-genai {og.__version__}, its builder's {precision} CPU model")


def llamacpp_peer(gguf: Path | None, threads: int, context: int) -> PeerRun:
    name = "llama.cpp"
    try:
        import llama_cpp
    except ImportError:
        return PeerRun(name, None, f"not installed ({INSTALL['llama.cpp']})")
    if gguf is None:
        return PeerRun(name, None, "the target is not a GGUF file (llama.cpp runs GGUF only)")
    failed = llamacpp_smoke(gguf, threads)
    if failed:
        return PeerRun(name, None, failed)
    llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                          n_batch=512, verbose=False, logits_all=False)
    eos = {llm.token_eos()}

    def generate(prompt: Sequence[int], max_new: int, temperature: float = 0.0, seed: int | None = None) -> int:
        llm.reset()
        if temperature > 0:
            llm.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF)
            tokens = llm.generate(list(prompt), temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                                  reset=True)
        else:
            tokens = llm.generate(list(prompt), temp=0.0, top_k=1, reset=True)
        made = 0
        for token in tokens:
            if token in eos:
                break
            made += 1
            if made >= max_new:
                break
        return made

    quant = Path(gguf).name
    return PeerRun(name, generate, f"llama-cpp-python {llama_cpp.__version__} on {quant}")


def llamacpp_smoke(gguf: Path, threads: int, timeout: float = 300.0) -> str | None:
    """Why llama.cpp cannot run `gguf` here (a short decode in a child process), or None where it can."""
    try:
        done = subprocess.run([sys.executable, "-c", _LLAMACPP_SMOKE, str(gguf), str(threads)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a 4-token llama.cpp decode did not finish in {timeout:.0f} s"
    if done.returncode < 0:
        return (f"llama.cpp crashed (signal {-done.returncode}) decoding 4 tokens; a build for this CPU's AMX "
                f"does that on machines that do not grant AMX state: rebuild it without: {LLAMACPP_PORTABLE}")
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        return f"llama.cpp failed to load {Path(gguf).name}: {last[0]}"
    return None


def torch_peer(loaded_target, threads: int) -> PeerRun:
    """specrt's torch backend, plain decoding on the same fp32 weights (seeded sampling at a temperature)."""
    import torch

    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.generate import generate_autoregressive
    from specrt.runtime.sampling import SamplingParams

    model = loaded_target.model
    engines: dict[int, TorchTargetEngine] = {}

    def generate(prompt: Sequence[int], max_new: int, temperature: float = 0.0, seed: int | None = None) -> int:
        torch.set_num_threads(threads)
        need = len(prompt) + max_new + 8
        engine = engines.get(need) or engines.setdefault(need, TorchTargetEngine(model, need))
        model.set_taps(())
        sampling = SamplingParams(temperature, seed=seed if temperature > 0 else None)
        result = generate_autoregressive(engine, [list(prompt)], max_new, sampling,
                                         model.config.eos_token_ids)
        return result.stats[0].new_tokens

    return PeerRun("specrt torch", generate, f"specrt's torch backend, torch {torch.__version__}, fp32")


def make_peers(names: Sequence[str], loaded_target, threads: int, context: int, progress=print) -> list[PeerRun]:
    from specrt.plugins.errors import SpecrtError

    runs: list[PeerRun] = []
    for name in names:
        if name not in PEERS:
            raise SpecrtError(f"--compare: unknown peer {name!r}", f"use a comma list of {', '.join(PEERS)}")
        if name == "torch":
            runs.append(torch_peer(loaded_target, threads))
        elif name == "llama.cpp":
            source = Path(str(loaded_target.source))
            runs.append(llamacpp_peer(source if source.suffix == ".gguf" else None, threads, context))
        else:
            runs.append(genai_peer(loaded_target, "fp32" if name == "ort-genai-fp32" else "int4", threads, progress))
    return runs


def time_peer(run: PeerRun, prompt: Sequence[int], max_new: int, temperature: float = 0.0,
              seed: int | None = None) -> tuple[int, float]:
    start = time.perf_counter()
    made = run.generate(prompt, max_new, temperature, seed)
    return made, time.perf_counter() - start
