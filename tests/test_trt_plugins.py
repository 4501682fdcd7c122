"""The tensorrt.plugin definitions of specrt's ops, run against a fake `tensorrt.plugin` (no TensorRT here).

`FakePluginAPI` implements the PluginAPI protocol (specrt.plugins.trt_api) and enforces the schema
rules TensorRT's `tensorrt.plugin` applies at registration (annotated TensorDesc inputs first, then
serializable attributes; aot_impl/impl/autotune argument lists; aot_impl's 4-tuple return
annotation). The AOT test compiles the real Triton kernels to PTX for sm_90 in a subprocess (the
other test files run Triton in interpreter mode, which cannot compile) and checks that the launch
parameters and extra arguments the plugin returns match the PTX entry and the torch wrapper.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from specrt.plugins.errors import SpecrtError
from specrt.plugins import trt_plugins
from specrt.plugins.confidence_truncate import INPUTS as CT_INPUTS
from specrt.plugins.tree_attention import INPUTS as TA_INPUTS

SERIALIZABLE = (int, float, bytes, bool, str)


class FakeDType:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


FLOAT, HALF, BF16, INT64, BOOL = (FakeDType(n) for n in ("FLOAT", "HALF", "BF16", "INT64", "BOOL"))


class FakeTensorDesc:
    def __init__(self, shape_expr=(), dtype=FLOAT) -> None:
        self.shape_expr = tuple(shape_expr)
        self.dtype = dtype

    def like(self) -> "FakeTensorDesc":
        return FakeTensorDesc(self.shape_expr, self.dtype)


class FakeTensor:
    pass


class FakeLaunch:
    def __init__(self) -> None:
        self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
        self.shared_mem = 0


class FakeSymIntExprs(tuple):
    @classmethod
    def from_tuple(cls, exprs):
        return cls(exprs)


class FakeCombination:
    def __init__(self, io_types=None, layouts=None, tactics=None) -> None:
        self.io_types = [s.strip() for s in io_types.split(",")] if io_types else []


class FakePluginAPI:
    """A stand-in for tensorrt.plugin with its registration-time checks."""

    TensorDesc = FakeTensorDesc
    Tensor = FakeTensor
    KernelLaunchParams = FakeLaunch
    SymIntExprs = FakeSymIntExprs
    AutoTuneCombination = FakeCombination

    def __init__(self) -> None:
        self.plugins: dict[str, dict[str, typing.Any]] = {}

    def _sig(self, fn):
        return inspect.signature(fn)

    def register(self, plugin_id, lazy_register=False):
        def wrap(fn):
            sig = self._sig(fn)
            tensors, attrs, seen_attr = [], [], False
            for name, p in sig.parameters.items():
                assert p.annotation is not inspect.Parameter.empty, f"{name} has no annotation"
                if isinstance(p.annotation, type) and issubclass(p.annotation, FakeTensorDesc):
                    assert not seen_attr, "TensorDescs and attributes interspersed"
                    tensors.append(name)
                else:
                    assert p.annotation in SERIALIZABLE, f"attribute {name}: {p.annotation}"
                    seen_attr = True
                    attrs.append(name)
            ret = sig.return_annotation
            outs = typing.get_args(ret) if typing.get_origin(ret) is tuple else (ret,)
            assert all(isinstance(o, type) and issubclass(o, FakeTensorDesc) for o in outs), ret
            self.plugins[plugin_id] = {"desc": fn, "tensors": tensors, "attrs": attrs, "outputs": len(outs)}
            return fn
        return wrap

    def _schema(self, plugin_id, fn, tail, tensor_type=FakeTensorDesc):
        plugin = self.plugins[plugin_id]  # register must come first
        sig = self._sig(fn)
        names = list(sig.parameters)
        attrs = [n for n in names if n in plugin["attrs"]]
        assert names == plugin["tensors"] + attrs + tail, (names, tail)
        register = self._sig(plugin["desc"]).parameters
        for name, p in sig.parameters.items():  # annotations are optional, but checked when given
            ann = p.annotation
            if ann is inspect.Parameter.empty:
                continue
            if name == "outputs":
                assert typing.get_origin(ann) is tuple and all(issubclass(a, tensor_type) for a in typing.get_args(ann))
            elif name in ("stream", "tactic"):
                assert ann is int
            elif name in plugin["attrs"]:
                assert ann == register[name].annotation, name
            else:
                assert issubclass(ann, tensor_type), name

    def autotune(self, plugin_id):
        def wrap(fn):
            self._schema(plugin_id, fn, ["outputs"])
            ret = self._sig(fn).return_annotation
            if ret is not inspect.Parameter.empty:  # only AutoTuneCombination or List[AutoTuneCombination]
                args = typing.get_args(ret) if typing.get_origin(ret) is list else (ret,)
                assert all(isinstance(a, type) and issubclass(a, FakeCombination) for a in args), ret
            self.plugins[plugin_id]["autotune"] = fn
            return fn
        return wrap

    def aot_impl(self, plugin_id):
        def wrap(fn):
            self._schema(plugin_id, fn, ["outputs", "tactic"])
            ret = self._sig(fn).return_annotation
            args = typing.get_args(ret)
            assert typing.get_origin(ret) is tuple and len(args) == 4, ret
            assert issubclass(args[2], FakeLaunch) and issubclass(args[3], FakeSymIntExprs), ret
            self.plugins[plugin_id]["aot"] = fn
            return fn
        return wrap

    def impl(self, plugin_id):
        def wrap(fn):
            self._schema(plugin_id, fn, ["outputs", "stream"], FakeTensor)
            assert self._sig(fn).return_annotation in (inspect.Parameter.empty, None)
            self.plugins[plugin_id]["impl"] = fn
            return fn
        return wrap

    def SymInt32(self, value):
        return int(value)

    def cdiv(self, first, second):
        return -(-int(first) // int(second))

    def from_shape_expr(self, shape_expr, dtype):
        return FakeTensorDesc(shape_expr, dtype)


def registered() -> FakePluginAPI:
    api = FakePluginAPI()
    assert trt_plugins.register_plugins(api, float32=FLOAT, int64=INT64) == [
        "specrt::TreeAttention", "specrt::ConfidenceTruncate"]
    return api


def test_trt_plugins_register_with_the_onnx_names_and_schemas():
    api = registered()
    ta, ct = api.plugins["specrt::TreeAttention"], api.plugins["specrt::ConfidenceTruncate"]
    assert ta["tensors"] == list(TA_INPUTS) and ta["attrs"] == ["scale"] and ta["outputs"] == 1
    assert ct["tensors"] == list(CT_INPUTS) and ct["attrs"] == [] and ct["outputs"] == 2
    assert all(k in ta and k in ct for k in ("autotune", "aot", "impl"))
    # registering twice with the same API object is a no-op
    assert trt_plugins.register_plugins(api, float32=FLOAT, int64=INT64) == ["specrt::TreeAttention",
                                                                              "specrt::ConfidenceTruncate"]


def test_trt_plugin_descriptors_and_type_combinations():
    api = registered()
    ta, ct = api.plugins["specrt::TreeAttention"], api.plugins["specrt::ConfidenceTruncate"]
    q = FakeTensorDesc((2, 9, 5, 64), HALF)
    descs = [q] + [FakeTensorDesc((2, 3, 5, 64), HALF)] * 4 + [FakeTensorDesc((2, 5, 33), BOOL)] * 2
    out = ta["desc"](*descs, 0.125)
    assert out.shape_expr == q.shape_expr and out.dtype is HALF
    combos = ta["autotune"](*descs, (out,))
    assert [c.io_types for c in combos] == [["FP32|FP16|BF16"] * 5 + ["BOOL", "BOOL", "FP32|FP16|BF16"]]
    conf = FakeTensorDesc((4, 7), HALF)
    survival, length = ct["desc"](conf, FakeTensorDesc((7,), HALF), FakeTensorDesc((), HALF), FakeTensorDesc((9,), HALF))
    assert survival.dtype is FLOAT and survival.shape_expr == (4, 7)
    assert length.dtype is INT64 and length.shape_expr == (4,)
    combos = ct["autotune"](conf, conf, conf, conf, (survival, length))
    assert combos[0].io_types[-2:] == ["FP32", "INT64"] and len(combos[0].io_types) == 6


def test_trt_attention_scalars_equal_the_wrapper_strides():
    """The AOT plugin's symbolic int32 arguments, evaluated on ints, equal what the torch wrapper passes."""
    import torch

    b, hq, hkv, t, d, c, s = 2, 9, 3, 5, 64, 40, 33
    q, k = torch.empty(b, hq, t, d), torch.empty(b, hkv, t, d)
    pk, pm, tm = torch.empty(b, hkv, c, d), torch.empty(b, t, s, dtype=torch.bool), torch.empty(b, t, t)
    want = [hkv, hq // hkv, t, s, d, *q.stride()[:3], *k.stride()[:3], *k.stride()[:3], *pk.stride()[:3],
            *pk.stride()[:3], *pm.stride()[:2], *tm.stride()[:2], *q.stride()[:3]]
    from specrt.plugins.triton_tree_attention import ATTENTION_SCALARS

    got = trt_plugins.attention_scalars(q.shape, k.shape, pk.shape, pm.shape)
    assert got == want and len(got) == len(ATTENTION_SCALARS)
    assert trt_plugins.confidence_scalars((4, 7), (29,)) == [4, 7, 29, 7]


def test_trt_plugin_dtype_names():
    assert [trt_plugins.triton_dtype(x) for x in (FLOAT, HALF, BF16)] == ["fp32", "fp16", "bf16"]
    with pytest.raises(SpecrtError, match="INT64"):
        trt_plugins.triton_dtype(INT64)


def test_trt_plugin_module_without_tensorrt_is_a_clear_error():
    from specrt.plugins import trt_api

    if trt_api.tensorrt_available():
        pytest.skip("TensorRT is installed here")
    with pytest.raises(SpecrtError) as err:
        trt_plugins.register_plugins()
    assert "TensorRT" in err.value.problem and "tensorrt" in err.value.fix


AOT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_trt_plugins as t
from specrt.plugins import trt_plugins
from specrt.plugins.triton_aot import entry_params
api = t.registered()
out = {}
b, hq, hkv, steps, d, c, s = 2, 9, 3, 5, 64, 40, 33
for dtype in (t.FLOAT, t.HALF):
    q = t.FakeTensorDesc((b, hq, steps, d), dtype)
    kv = t.FakeTensorDesc((b, hkv, steps, d), dtype)
    cache = t.FakeTensorDesc((b, hkv, c, d), dtype)
    pm, tm = t.FakeTensorDesc((b, steps, s), t.BOOL), t.FakeTensorDesc((b, steps, steps), t.BOOL)
    name, ptx, launch, extra = api.plugins["specrt::TreeAttention"]["aot"](q, kv, kv, cache, cache, pm, tm, 0.125,
                                                                            (q.like(),), 0)
    open(sys.argv[2] + f"/attention_{dtype.name}.ptx", "wb").write(ptx)
    out[dtype.name] = dict(name=name.decode(), params=len(entry_params(ptx.decode(), name.decode())),
                           extra=list(extra), grid=[launch.grid_x, launch.grid_y], block=launch.block_x,
                           shared=launch.shared_mem)
conf = t.FakeTensorDesc((4, 7), t.FLOAT)
sps = t.FakeTensorDesc((29,), t.FLOAT)
name, ptx, launch, extra = api.plugins["specrt::ConfidenceTruncate"]["aot"](conf, t.FakeTensorDesc((7,)),
    t.FakeTensorDesc(()), sps, (conf.like(), t.FakeTensorDesc((4,), t.INT64)), 0)
open(sys.argv[2] + "/confidence.ptx", "wb").write(ptx)
out["confidence"] = dict(name=name.decode(), params=len(entry_params(ptx.decode(), name.decode())),
                         extra=list(extra), grid=[launch.grid_x, launch.grid_y], block=launch.block_x)
print(json.dumps(out))
"""


def _ptxas() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() else None


def test_trt_aot_impl_compiles_triton_kernels_to_ptx_for_sm90(tmp_path):
    """aot_impl end to end without a GPU: PTX for sm_90 (PTX ISA 8.3), assembled by the bundled ptxas."""
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("triton (with its bundled ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SPECRT_PTX_VERSION="83", TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")
    # compile for sm_90 whatever the machine: current_target() needs a GPU, so pin it for the subprocess
    script = AOT_SCRIPT.replace("import json, sys", "import json, sys\nimport specrt.plugins.triton_aot as A\n"
                                "A.current_target = lambda: (90, 32)")
    proc = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    from specrt.plugins.triton_tree_attention import ATTENTION_POINTERS, ATTENTION_SCALARS

    for dtype in ("FLOAT", "HALF"):
        info = out[dtype]
        # TensorRT passes inputs, extra scalars, outputs: exactly the PTX entry's parameters
        assert info["params"] == len(ATTENTION_POINTERS) + len(info["extra"]) + 1
        assert len(info["extra"]) == len(ATTENTION_SCALARS)
        assert info["extra"][:5] == [3, 3, 5, 33, 64]
        assert info["grid"] == [2 * 3, -(-(3 * 5) // 16)] and info["block"] == 128
        assert 0 < info["shared"] <= 48 * 1024  # no opt-in to large shared memory needed
    conf = out["confidence"]
    assert conf["params"] == 4 + 4 + 2 and conf["extra"] == [4, 7, 29, 7] and conf["grid"] == [1, 1]
    for ptx in sorted(tmp_path.glob("*.ptx")):
        result = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (ptx.name, result.stderr[-2000:])
        assert ptx.with_suffix(".cubin").stat().st_size > 0
