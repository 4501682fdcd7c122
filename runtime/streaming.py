"""Incremental detokenisation: turn a growing list of ids into text pieces safe to print.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a prefix gives
U+FFFD. We hold text back until it no longer ends in a replacement character, and emit only what
is new since the last emission.
"""

from __future__ import annotations

from typing import Callable

from specrt.export.tokenizer import ChatTokenizer


class TextStream:
    def __init__(self, tokenizer: ChatTokenizer, write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        if text.startswith(self.emitted):
            self.write(text[len(self.emitted):])
        self.emitted = text

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids)
        if len(text) > len(self.emitted) and text.startswith(self.emitted):
            self.write(text[len(self.emitted):])
        self.emitted = text
