"""Single-stream calls of the ORT-fused target graph bound once, with nothing rebuilt per call.

    call = BoundTargetCall(model, k_cache, v_cache)   # model: an OrtTargetModel with a fused graph
    logits, taps = call.forward(input_ids, position_ids, new_mask, logit_rows, length)

`OrtTargetEngine` hands every batch-1 call here: `TargetEngine.forward`'s arguments and the row's
committed length give the same logits and taps, bitwise, as the general path (`TorchTargetEngine.
forward` -> `OrtTargetModel.__call__` -> `OrtGraph.run`), which per call builds a [B, T, W] window
mask, turns it into an additive bias, allocates the int32 scalars and walks a feeds dict of 2 x layers
cache views and their present_* outputs. Here the cache views are bound once (as past_* and as the
present_* buffers GroupQueryAttention writes in place), and:

- decode (one token seeing every committed slot: a plain decoding step, a verify step without
  drafts): token, position and the two int32 scalars are written into numpy arrays bound once; the
  bias, all zeros, is one preallocated buffer whose first `rows * total` entries are re-bound.
- verify (T > 1 tokens: a prompt, a draft chain or tree): ids, positions and logit rows are bound
  as given, the bias [T, total] is built in numpy from new_mask.

A caller may keep logits and taps past the next call. Taps get fresh tensors every call; logits
reuse the previous call's tensor when nothing outside this object holds it, a view of it or an
array over it any more (its Python references and its storage's use count), since a fresh 192 KiB
tensor per token costs page faults on the graph's write and the argmax's read, about 0.1 ms of a
one-token step; a held one is left alone. A greedy one-token call (`decode(..., argmax=True)`) hands
back the argmax alone, from a numpy buffer of this object's own, and runs no torch op: right after a
call the interpreter's working set is out of the caches, so each torch op costs tens of microseconds.

Attention rows (`OrtTargetModel.attention_row_decode`, int8-activation engines) are reproduced
exactly: a one-token call runs two attention rows, the position twice, the bias's first row hiding
the spare slot the second row writes (`with_attention_row`). Two-row decoding's copy row
(`with_copy_row`) needs only that too, since the linear layers' rows do not depend on each other.
At the cache end, where the general path has no spare slot for that row, it takes the call.

On the causal twin (`OrtTargetModel.causal_only`: no attention_bias or position_ids inputs) nothing
but ids and the two scalars is bound, and a call it cannot express (a tree, a position other than
its slot) goes to the general path, which sends it to the portable graph.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

# the storage's holders: a reused logits tensor must have none but this object (module docstring)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16}


def attention_rows(model) -> int:
    """Attention's rows in a one-token call: 2 where the general path runs a second row (attention
    rows for plain decoding; two-row decoding's copy row, whose linear-layer rows leave the token's
    own row bitwise unchanged, so attention rows give that row too), else 1."""
    return 2 if model.attention_row_decode or model.two_row_decode else 1


def is_causal_run(position_ids: torch.Tensor, new_mask: torch.Tensor, length: int) -> bool:
    """T new tokens of one row that the causal twin expresses: at positions length .. length+T-1 (their
    slots), each seeing every committed slot (the caller's window) and the new tokens up to itself."""
    t = int(position_ids.shape[-1])
    positions = torch.arange(length, length + t, dtype=position_ids.dtype)
    causal = torch.ones(t, t, dtype=torch.bool).tril_()
    return bool(torch.equal(position_ids.reshape(-1), positions)) and bool(torch.equal(new_mask.reshape(t, t), causal))


class BoundTargetCall:
    """The fused target graph's calls over one cache, bound once (module docstring)."""

    def __init__(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        graph = model.fused
        self.graph = graph
        self.model = model
        self.k_cache, self.v_cache = k_cache, v_cache
        self.slots = int(k_cache.shape[-2])  # cache slots, spare ones included
        self.rows = attention_rows(model)
        self.causal_only = model.causal_only  # no attention_bias / position_ids inputs (module docstring)
        self.taps = bool(model.tap_layers)
        c = model.config
        self.vocab = int(c.vocab_size)
        self.binding = binding = graph.session.io_binding()
        # decode inputs written in place each call; seqlens_k / total_sequence_length bound once
        self.ids = np.zeros((1, 1), dtype=np.int64)
        self.positions = np.zeros((1, self.rows), dtype=np.int64)
        self.seqlens = np.zeros((1,), dtype=np.int32)
        self.total = np.zeros((), dtype=np.int32)
        self.logit_rows = np.zeros((1, 1), dtype=np.int64)
        binding.bind_input("seqlens_k", "cpu", 0, np.int32, [1], self.seqlens.ctypes.data)
        binding.bind_input("total_sequence_length", "cpu", 0, np.int32, [], self.total.ctypes.data)
        # attention_bias [1, 1, rows, total], row-major: zeros (every slot visible) except, with
        # attention rows, the first row's last entry (flat index total - 1), the slot the second row
        # writes. One buffer for the longest window; a call binds its first rows * total entries.
        self.bias = np.zeros(self.rows * self.slots, dtype=_NUMPY[model.dtype])
        self.hidden_at = -1  # the flat index holding -inf (attention rows)
        self.decode_bound = False  # input_ids, position_ids, logit_rows bound to the arrays above
        cache_type = _NUMPY[k_cache.dtype]
        cache_shape = list(k_cache.shape[1:])
        for i in range(k_cache.shape[0]):
            for kind, cache in (("key", k_cache), ("value", v_cache)):
                pointer = cache[i].data_ptr()
                binding.bind_input(f"past_{kind}_{i}", "cpu", 0, cache_type, cache_shape, pointer)
                binding.bind_output(f"present_{kind}_{i}", "cpu", 0, cache_type, cache_shape, pointer)
        self.taps_width = len(model.tap_layers) * int(c.hidden_size)
        self.logits: torch.Tensor | None = None  # the last call's, reused while nobody else holds it
        self.bound_logits: tuple[int, int] | None = None  # (address, rows) the logits output is bound to
        self.argmax_logits = np.empty((1, 1, self.vocab), dtype=np.float32)  # decode(argmax=True): never handed out

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, new_mask: torch.Tensor,
                logit_rows: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`TargetEngine.forward` of one row whose `length` slots are committed, or None where the
        general path must take the call (a one-token call that does not see itself, no room left)."""
        t = input_ids.shape[1]
        if t == 1:
            if length + self.rows > self.slots or not new_mask.item():
                return None  # the general path's one-row call at the cache end (module docstring)
            if logit_rows is not None and logit_rows.item() != 0:
                return None
            position = position_ids.item()
            if self.causal_only and position != length:
                return None
            return self.decode(input_ids.item(), position, length)
        if length + t > self.slots:
            return None  # the general path refuses it with the capacity error
        if self.causal_only and not is_causal_run(position_ids, new_mask, length):
            return None
        return self.verify(input_ids, position_ids, new_mask, logit_rows, length)

    def decode(self, token: int, position: int, length: int,
               argmax: bool = False) -> tuple[torch.Tensor | int, torch.Tensor | None]:
        """One token at `position`, written to slot `length` (attention rows: and a copy to the next).
        argmax: hand back the logits' argmax (numpy's: the first of equal maxima, as `row_argmax`)
        instead of the logits, for a greedy step (module docstring)."""
        total = length + self.rows
        self.ids[0, 0] = token
        self.seqlens[0] = total - 1
        self.total.fill(total)
        binding = self.binding
        if not self.causal_only:
            self.positions.fill(position)
            bias = self.bias
            if self.rows == 2 and self.hidden_at != total - 1:
                if self.hidden_at >= 0:
                    bias[self.hidden_at] = 0
                bias[total - 1] = -np.inf
                self.hidden_at = total - 1
            binding.bind_input("attention_bias", "cpu", 0, bias.dtype, [1, 1, self.rows, total], bias.ctypes.data)
        if not self.decode_bound:  # a verify call bound its own arrays since
            binding.bind_input("input_ids", "cpu", 0, np.int64, [1, 1], self.ids.ctypes.data)
            if not self.causal_only:
                binding.bind_input("position_ids", "cpu", 0, np.int64, [1, self.rows], self.positions.ctypes.data)
            binding.bind_input("logit_rows", "cpu", 0, np.int64, [1, 1], self.logit_rows.ctypes.data)
            self.decode_bound = True
        if argmax:
            return self._run_argmax()
        return self._run(1, 1)

    def verify(self, input_ids: torch.Tensor, position_ids: torch.Tensor, new_mask: torch.Tensor,
               logit_rows: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """T > 1 new tokens (a prompt, a draft chain or tree) in slots length .. length+T-1: the committed
        slots visible to all, the new ones as `new_mask` [1, T, T] says (causal, or ancestor-or-self)."""
        t = int(input_ids.shape[1])
        total = length + t
        self.seqlens[0] = total - 1
        self.total.fill(total)
        ids = np.ascontiguousarray(input_ids.numpy(), dtype=np.int64)
        rows = np.arange(t, dtype=np.int64)[None] if logit_rows is None else \
            np.ascontiguousarray(logit_rows.numpy(), dtype=np.int64)
        binding = self.binding
        if not self.causal_only:
            bias = np.zeros((t, total), dtype=self.bias.dtype)
            bias[:, length:][~new_mask[0].numpy().astype(bool, copy=False)] = -np.inf
            positions = np.ascontiguousarray(position_ids.numpy(), dtype=np.int64)
            binding.bind_input("attention_bias", "cpu", 0, bias.dtype, [1, 1, t, total], bias.ctypes.data)
            binding.bind_input("position_ids", "cpu", 0, np.int64, [1, t], positions.ctypes.data)
        binding.bind_input("input_ids", "cpu", 0, np.int64, [1, t], ids.ctypes.data)
        binding.bind_input("logit_rows", "cpu", 0, np.int64, list(rows.shape), rows.ctypes.data)
        self.decode_bound = False
        return self._run(int(rows.shape[1]), t)

    def _run(self, logit_rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self._logits_tensor(logit_rows)
        self._bind_logits(logits.data_ptr(), logit_rows)
        taps = self._run_with_taps(tokens)
        return logits, taps

    def _run_argmax(self) -> tuple[int, torch.Tensor | None]:
        buffer = self.argmax_logits
        self._bind_logits(buffer.ctypes.data, 1)
        taps = self._run_with_taps(1)
        return int(buffer.argmax()), taps

    def _bind_logits(self, address: int, rows: int) -> None:
        """Point the logits output at [1, rows, V] floats at `address`, unless it already is: a binding
        keeps its outputs from call to call. (An address, not the tensor: holding the tensor here would
        count as a holder and stop its reuse.)"""
        if self.bound_logits != (address, rows):
            self.binding.bind_output("logits", "cpu", 0, np.float32, [1, rows, self.vocab], address)
            self.bound_logits = (address, rows)

    def _run_with_taps(self, tokens: int) -> torch.Tensor | None:
        """Run the bound call; its taps in a fresh tensor (a proposer may keep them past the next call:
        lazy ingest), or None."""
        taps = None
        if self.taps:
            taps = torch.empty((1, tokens, self.taps_width), dtype=self.model.dtype)
            self.binding.bind_output("taps", "cpu", 0, _NUMPY[self.model.dtype], [1, tokens, self.taps_width],
                                     taps.data_ptr())
        self.graph.run_bound(self.binding)
        self.model.fused_calls += 1
        return taps

    def _logits_tensor(self, rows: int) -> torch.Tensor:
        """[1, rows, V] for this call: the last call's tensor where its shape fits and nothing else
        holds it, else fresh. Held means another Python reference (a caller's name, a view's base) or
        another storage holder (a numpy array; two are ours: the tensor and the probe's storage object)."""
        last = self.logits
        if (last is not None and _storage_use_count is not None and last.shape[1] == rows
                and sys.getrefcount(last) == 3  # self.logits, `last`, getrefcount's argument
                and _storage_use_count(last.untyped_storage()._cdata) == 2):
            return last
        self.logits = torch.empty((1, rows, self.vocab), dtype=torch.float32)
        return self.logits
