"""The tokenizer built from GGUF metadata against transformers' own GGUF conversion."""

from __future__ import annotations

import pytest

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "numbers 12345 and 3.14159, dates 2026-11-30",
    "café naïve 東京 😀 emoji",
    "def f(x):\n\treturn x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Don't we'll they're I'm",
    "\n\n\nmany\n\nnewlines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(default_target, hf_default_tokenizer, text):
    ours = default_target.tokenizer.encode(text)
    assert ours == hf_default_tokenizer.encode(text, add_special_tokens=False)
    assert default_target.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(default_target, hf_default_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ours = default_target.tokenizer.render_chat(messages)
    theirs = hf_default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_eos_includes_end_of_turn(default_target):
    tok = default_target.tokenizer
    assert tok.tokenizer.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_save_and_reload(default_target, tmp_path):
    from specrt.export.tokenizer import chat_tokenizer_from_folder

    default_target.tokenizer.save(tmp_path)
    again = chat_tokenizer_from_folder(tmp_path)
    assert again.encode_chat("hello") == default_target.tokenizer.encode_chat("hello")
    assert again.eos_token_ids == default_target.tokenizer.eos_token_ids
