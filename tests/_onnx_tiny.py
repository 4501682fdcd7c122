"""Tiny random target + drafters for the ONNX export tests (seconds, not minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specrt.export.models.config import LlamaConfig
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.export.models.llama import LlamaModel

TARGET_CFG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4, num_kv_heads=2,
    rope_theta=10000.0, max_position_embeddings=128, eos_token_ids=[1],
)


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere, norms around 1, so mixed-up tensors show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return module.eval()


def make_target(cfg: LlamaConfig = TARGET_CFG, seed: int = 0) -> LlamaModel:
    return randomize(LlamaModel(cfg), seed)


def make_sharp_target(cfg: LlamaConfig = TARGET_CFG, seed: int = 0) -> LlamaModel:
    """make_target with a 3x LM head: sharper distributions, so greedy paths have no near-ties that
    another backend's float rounding could flip (the engine tests compare tokens across backends)."""
    target = make_target(cfg, seed)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    return target


def make_drafters(target: LlamaModel, seed: int = 1) -> dict[str, torch.nn.Module]:
    cfg = target.config
    eagle = Eagle3Drafter(Eagle3Config.for_target(cfg, draft_vocab_size=40, intermediate_size=40))
    g = torch.Generator().manual_seed(seed)
    targets = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:40]).values
    eagle.d2t.copy_(targets - torch.arange(40))
    eagle.t2d.zero_()
    eagle.t2d[targets] = True
    dflash = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=2, block_size=4, num_taps=3, intermediate_size=40))
    # DSpark with more K/V heads than the target (4 against 2): graphs and caches follow the drafter's own width
    dspark = DSparkDrafter(DSparkConfig.for_target(cfg, num_layers=2, block_size=4, num_taps=3, intermediate_size=40,
                                                   markov_rank=8, num_kv_heads=4))
    dspark.sts_temperatures.copy_(torch.tensor([1.0, 1.3, 0.8, 1.6]))
    out = {"eagle3": eagle, "dflash": dflash, "dspark": dspark}
    for i, (kind, d) in enumerate(out.items()):
        randomize(d, seed + i)
        if kind == "eagle3":
            d.bind_target_embedding(target.embed_tokens)
        else:
            d.bind_target(target.embed_tokens, target.lm_head)
    return out


def write_hf_target(folder: Path, model: LlamaModel) -> Path:
    """An HF-style folder (config.json, model.safetensors, tokenizer files) of a tiny Llama."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = model.config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "eos_token_id": 1, "bos_token_id": 0,
    }))
    state = {f"model.{k}" if not k.startswith("lm_head") else k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}", "eos_token": "</s>",
        "bos_token": "<s>",
    }))
    return folder


def last_logits(model, ids: list[int], step: int) -> torch.Tensor:
    """An ORT target model's logits for the last of `ids` (a 4-token prompt, then `step` tokens per
    call): step 1 is decoding, a large step one verify call; exact engines give equal tensors."""
    k, v = model.new_cache(1, 32)
    pos, out = 0, None
    while pos < len(ids):
        t = 4 if pos == 0 else min(step, len(ids) - pos)
        x, p = torch.tensor([ids[pos:pos + t]]), torch.arange(pos, pos + t)[None]
        mask = torch.ones(1, t, pos + t, dtype=torch.bool)
        mask[0, :, pos:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
        out, _ = model(x, p, mask, k, v, p, torch.tensor([[t - 1]]))
        pos += t
    return out[0, 0]
