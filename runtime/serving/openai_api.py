"""The OpenAI request fields specrt serves, their validation, and the response objects.

Parsing is by hand (not pydantic) so every refusal is a 400 in OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, naming the field and what to send instead.
Supported: model, prompt (one string or one token-id list) / messages, max_tokens
(max_completion_tokens), temperature (0..2), top_p, top_k (extension), seed, stop (up to 4
strings), stream, stream_options.include_usage, n = 1, ignore_eos (extension). Fields that would
change the output and are not implemented (logprobs, echo, best_of > 1, penalties, logit_bias, tools)
are refused rather than ignored; unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specrt.runtime.sampling import SamplingParams

MAX_STOPS = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    model: str
    chat: bool
    prompt_text: str | None = None  # completions with a string prompt
    prompt_ids: list[int] | None = None  # completions with token ids
    messages: list[dict] | None = None  # chat
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ApiError(400, f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, low: int | None = None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if low is not None and value < low:
        raise ApiError(400, f"'{name}' must be >= {low}, got {value}", name, "invalid_value")
    return value


def _refuse_unsupported(body: dict) -> None:
    checks = [
        ("logprobs", lambda v: v not in (None, False, 0)), ("top_logprobs", lambda v: v not in (None, 0)),
        ("echo", lambda v: v not in (None, False)), ("best_of", lambda v: v not in (None, 1)),
        ("presence_penalty", lambda v: v not in (None, 0, 0.0)), ("frequency_penalty", lambda v: v not in (None, 0, 0.0)),
        ("logit_bias", lambda v: v not in (None, {})), ("tools", lambda v: v not in (None, [])),
        ("functions", lambda v: v not in (None, [])), ("suffix", lambda v: v not in (None, "")),
    ]
    for name, bad in checks:
        if name in body and bad(body[name]):
            raise ApiError(400, f"'{name}' is not supported by specrt serve", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported", "response_format",
                       "unsupported_parameter")


def _common(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (a model id from /v1/models, or 'default')", "model", "missing")
    _refuse_unsupported(body)
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", "n", "unsupported_value")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0) or 0
    seed = _integer(body, "seed")
    max_tokens = _integer(body, "max_tokens", 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOPS or any(s == "" for s in stops):
        raise ApiError(400, f"'stop' takes up to {MAX_STOPS} non-empty strings", "stop", "invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be true or false", "ignore_eos", "invalid_type")
    sampling = SamplingParams(temperature=temperature, top_k=int(top_k), top_p=top_p, seed=seed)
    return ParsedRequest(model=model, chat=chat, max_tokens=max_tokens, sampling=sampling, stop=stops,
                         stream=stream, include_usage=bool(options.get("include_usage", False)), ignore_eos=ignore_eos)


def parse_completion(body: Any) -> ParsedRequest:
    req = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt", "invalid_value")
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "one prompt per request: send several requests (they are batched on the server)",
                       "prompt", "unsupported_value")
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt", "invalid_type")
    return req


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", "messages", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    if value is None:
        return ""
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts", "messages", "invalid_type")


def parse_chat(body: Any) -> ParsedRequest:
    req = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", "messages", "invalid_type")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: 'role' must be system, user or assistant", "messages", "invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": _content(m.get("content"), f"messages[{i}]")})
    req.messages = clean
    return req


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cache_full": "length", "cancelled": "stop"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, chat: bool, text: str, finish: str, use: dict, extra: dict) -> dict:
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "specrt": extra}


def chunk_body(rid: str, model: str, chat: bool, text: str | None, finish: str | None, role: bool = False,
               use: dict | None = None, empty_choices: bool = False) -> dict:
    created = int(time.time())
    if empty_choices:
        choices: list = []
    elif chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body
