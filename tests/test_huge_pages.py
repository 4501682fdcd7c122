"""Large anonymous memory moves onto 2 MiB pages after a session loads; sparse memory stays put."""

from __future__ import annotations

import mmap
import platform
import re
import sys

import numpy as np
import pytest

from specrt.runtime.backends import huge_pages
from specrt.runtime.backends.huge_pages import anonymous_mappings, back_with_huge_pages, thp_mode

SMAPS = """\
55d0c0000000-55d0c0400000 rw-p 00000000 00:00 0                          [heap]
Size:               4096 kB
Rss:                4000 kB
AnonHugePages:      2048 kB
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
Rss:                1024 kB
AnonHugePages:         0 kB
7f1000000000-7f1000200000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
Size:               2048 kB
Rss:                2048 kB
7f2000000000-7f2000400000 rw-s 00000000 00:05 99                         /dev/shm/x
Size:               4096 kB
Rss:                4096 kB
7f3000000000-7f3000400000 rw-p 00000000 08:01 77                         /data/weights.bin
Rss:                4096 kB
"""


def test_the_smaps_reader_keeps_private_anonymous_mappings_and_the_heap():
    found = anonymous_mappings(SMAPS)
    assert [(m.start, m.end) for m in found] == [(0x55D0C0000000, 0x55D0C0400000), (0x7F0000000000, 0x7F0000800000)]
    assert [(m.resident, m.huge) for m in found] == [(4000 * 1024, 2048 * 1024), (1024 * 1024, 0)]


def mapping_of(address: int):
    with open("/proc/self/smaps") as f:
        for m in anonymous_mappings(f.read()):
            if m.start <= address < m.end:
                return m
    raise AssertionError(f"no anonymous mapping holds {address:#x}")


def needs_collapse():
    if not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"):
        pytest.skip(f"needs Linux with transparent huge pages on (mode here: {thp_mode()})")
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", platform.release()).groups())
    if (major, minor) < (6, 1):
        pytest.skip(f"MADV_COLLAPSE needs Linux 6.1+, this is {platform.release()}")


def private_mapping(size: int) -> tuple[mmap.mmap, int]:
    """A fresh private anonymous mapping (never memory an earlier test left on huge pages) and its address."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8).ctypes.data


def test_a_resident_buffer_moves_onto_huge_pages_and_a_sparse_one_does_not():
    needs_collapse()
    dense, dense_at = private_mapping(24 << 20)
    np.frombuffer(dense, dtype=np.uint8)[:] = 1  # every page written: fully resident
    sparse, sparse_at = private_mapping(64 << 20)
    sparse[0] = 1  # one page of 64 MiB
    report = back_with_huge_pages()
    assert report.unavailable is None and report.collapsed > 0, report
    # madvise splits the mapping at 2 MiB boundaries: the buffer's middle is in the advised part
    assert mapping_of(dense_at + (12 << 20)).huge >= 16 << 20
    left = mapping_of(sparse_at)
    assert left.huge == 0 and left.resident < 1 << 20  # not made resident by a collapse
    assert report.skipped_sparse > 0
    again = back_with_huge_pages()  # what is already huge is skipped, not redone
    assert again.collapsed < report.collapsed
    dense.close()
    sparse.close()


def test_nothing_is_tried_where_the_system_offers_no_huge_pages(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", mode)
    report = back_with_huge_pages()
    assert report.unavailable and "off" in report.unavailable and report.collapsed == report.advised == 0
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", tmp_path / "missing")
    assert back_with_huge_pages().unavailable


def test_sessions_ask_for_huge_pages_unless_told_not_to(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from specrt.runtime.backends.ort_session import OrtGraph, SessionOptions

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "identity.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    assert OrtGraph(path, {}, SessionOptions(threads=1, huge_pages=False)).huge_pages is None
    assert isinstance(OrtGraph(path, {}, SessionOptions(threads=1)).huge_pages, huge_pages.HugePageReport)


def test_the_doctor_says_whether_engines_get_huge_pages(monkeypatch, tmp_path):
    from specrt.runtime import doctor

    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", mode)
    mode.write_text("always [madvise] never\n")
    assert "madvise" in dict(doctor.report())["huge pages"]
    mode.write_text("always madvise [never]\n")
    line = dict(doctor.report())["huge pages"]
    assert line.startswith("off") and "echo madvise >" in line
