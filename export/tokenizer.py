"""Tokenizer and chat template of a target, from GGUF metadata or an HF folder.

The tokenizer is a `tokenizers.Tokenizer` (the Rust library), built from the GGUF vocabulary and
merges rather than by a hand-written BPE. The pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre`
name (the GGUF records which HF pre-tokenizer the model was trained with). The chat template is
rendered with jinja2's sandbox, as transformers does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from specrt.plugins.errors import SpecrtError

# Split patterns of the BPE pre-tokenizers llama.cpp knows by name.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL = 3  # llama.cpp token type of special (control) tokens


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "olmo"):
        return byte_level
    pattern = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}.get(pre)
    if pattern is None:
        raise SpecrtError(
            f"GGUF tokenizer pre-tokenizer '{pre}' is not supported",
            "use an HF folder with tokenizer.json, or a GGUF of a supported model (smollm, gpt2, llama-bpe, qwen2)",
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecrtError(
            f"{source}: GGUF tokenizer model '{kind}' is not supported (only byte-level BPE, 'gpt2')",
            "use an HF folder with tokenizer.json for this model",
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    specials = [tokens[i] for i, t in enumerate(types) if int(t) == _CONTROL]
    if specials:
        tok.add_special_tokens(specials)
    return tok


@dataclass
class ChatTokenizer:
    """Tokenizer + chat template + special ids: all the runtime needs to turn a prompt into ids."""

    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise SpecrtError("this model has no chat template", "pass --no-chat-template to send the raw prompt")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise SpecrtError(f"chat template refused the messages: {message}", "check the roles and order of the messages")

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode(self.render_chat(messages))

    def save(self, folder: Path) -> None:
        """Write tokenizer.json + chat_template/special ids, the files an engines folder ships."""
        self.tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {"chat_template": self.chat_template, "eos_token_ids": self.eos_token_ids,
                 "bos_token": self.bos_token, "eos_token": self.eos_token},
                indent=2,
            )
        )


def eos_ids_for(tokenizer: Tokenizer, declared: list[int]) -> list[int]:
    """Declared eos plus the chat end-of-turn markers the vocabulary has (chat models stop on them)."""
    ids = list(dict.fromkeys(declared))
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>"):
        token_id = tokenizer.token_to_id(marker)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


def chat_tokenizer_from_gguf(meta: dict[str, Any], source: str) -> ChatTokenizer:
    tok = tokenizer_from_gguf(meta, source)
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ChatTokenizer(
        tokenizer=tok,
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=eos_ids_for(tok, [] if eos is None else [int(eos)]),
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
    )


def chat_tokenizer_from_folder(folder: str | Path, declared_eos: list[int] | None = None) -> ChatTokenizer:
    """HF folder (tokenizer.json + tokenizer_config.json) or an engines folder written by `save`."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise SpecrtError(f"tokenizer.json not found in {folder}", "the checkpoint folder needs the tokenizer files")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:
        raise SpecrtError(f"{path} is corrupt ({err})", "download or export the model again") from None
    config: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()

    def content(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    eos_token = content(config.get("eos_token"))
    declared = list(config.get("eos_token_ids") or declared_eos or [])
    if eos_token and tok.token_to_id(eos_token) is not None:
        declared.append(tok.token_to_id(eos_token))
    return ChatTokenizer(tok, template, eos_ids_for(tok, declared), content(config.get("bos_token")), eos_token)
