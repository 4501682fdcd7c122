"""Trimming Triton's hidden scratch parameters from PTX entries (specrt.plugins.triton_aot), on synthetic PTX."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from specrt.plugins.errors import SpecrtError
from specrt.plugins.triton_aot import entry_params, trim_hidden_params

PTX = """.version 8.3
.target sm_90a
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3,
\t.param .u64 .ptr .global .align 1 k_param_4
)
.reqntid 128
{
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b32 \t%r1, [k_param_1];
\tld.param.b64 \t%rd2, [k_param_2];
\tret;
}
"""
NO_SCRATCH = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0)


def test_triton_aot_trims_unused_trailing_scratch_params():
    trimmed = trim_hidden_params(PTX, "k", 3, NO_SCRATCH)
    assert [p.split()[-1] for p in entry_params(trimmed, "k")] == ["k_param_0", "k_param_1", "k_param_2"]
    assert trimmed.split(")", 1)[1] == PTX.split(")", 1)[1]  # the body is untouched
    assert trim_hidden_params(trimmed, "k", 3, NO_SCRATCH) == trimmed  # nothing left to trim


def test_triton_aot_refuses_scratch_it_cannot_drop():
    with pytest.raises(SpecrtError, match="global_scratch_size"):
        trim_hidden_params(PTX, "k", 3, SimpleNamespace(global_scratch_size=256, profile_scratch_size=0))
    reads_hidden = PTX.replace("\tret;", "\tld.param.b64 \t%rd3, [k_param_3];\n\tret;")
    with pytest.raises(SpecrtError, match="k_param_3"):
        trim_hidden_params(reads_hidden, "k", 3, NO_SCRATCH)
    with pytest.raises(SpecrtError, match="declares 5 parameters"):
        trim_hidden_params(PTX, "k", 1, NO_SCRATCH)
    with pytest.raises(ValueError):
        entry_params(PTX, "other")
