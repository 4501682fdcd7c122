"""Our Llama-family model against transformers' implementation on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from conftest import run_full

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def test_smollm2_logits_and_taps_match_transformers(default_target, hf_default_model):
    model = default_target.model
    # index 30 (= L) is left out on purpose: transformers' last hidden state has the final norm
    # applied, ours is the raw output of the last layer (see LlamaModel docstring)
    taps = [0, 2, 15, 27, 29]
    model.set_taps(taps)
    try:
        ids = torch.tensor([default_target.tokenizer.encode_chat("Explain speculative decoding in one paragraph.")])
        logits, tap_out = run_full(model, ids)
        with torch.no_grad():
            ref = hf_default_model(ids, output_hidden_states=True)
    finally:
        model.set_taps([])
    assert (logits - ref.logits).abs().max().item() <= TOL
    h = model.config.hidden_size
    for j, index in enumerate(taps):
        ours = tap_out[..., j * h:(j + 1) * h]
        theirs = ref.hidden_states[index]
        # hidden states grow to O(100) in the last layers: compare relative to their scale
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item()), index


def _random_hf_model(kind: str, tmp_path, shard: bool):
    torch.manual_seed(0)
    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    if kind == "llama3":
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, rope_theta=1e6)
        cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "1GB")
    return model


@pytest.mark.parametrize("kind,shard", [("llama3", True), ("qwen2", False), ("qwen3", True)])
def test_random_family_members_match_transformers(kind, shard, tmp_path):
    from specrt.export.checkpoints.hf import load_hf_folder

    ref = _random_hf_model(kind, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_hf_folder(tmp_path)
    assert ours.config.model_type == ("llama" if kind == "llama3" else kind)
    if kind == "llama3":
        assert ours.config.rope_scaling["rope_type"] == "llama3"
    ours.set_taps([0, 1, 2])
    # positions beyond original_max_position_embeddings exercise the llama3 rope scaling
    ids = torch.randint(0, 300, (2, 150))
    logits, taps = run_full(ours, ids)
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
    assert (logits - out.logits).abs().max().item() <= TOL
    h = ours.config.hidden_size
    for j, index in enumerate([0, 1, 2]):
        assert torch.allclose(taps[..., j * h:(j + 1) * h], out.hidden_states[index], atol=1e-4), index


def test_logit_rows_select_rows(tmp_path):
    from specrt.export.checkpoints.hf import load_hf_folder

    _random_hf_model("qwen2", tmp_path, False)
    model = load_hf_folder(tmp_path)
    ids = torch.randint(0, 300, (2, 12))
    full, _ = run_full(model, ids)
    k, v = model.new_cache(2, 12)
    pos = torch.arange(12).expand(2, 12)
    mask = torch.tril(torch.ones(12, 12, dtype=torch.bool)).expand(2, 12, 12)
    rows = torch.tensor([[11, 3], [0, 7]])
    with torch.no_grad():
        sel, taps = model(ids, pos, mask, k, v, pos, rows)
    assert taps is None
    assert torch.allclose(sel, torch.stack([full[0, [11, 3]], full[1, [0, 7]]]), atol=1e-5)
