"""mypy over specrt's TensorRT code, typed by tensorrt-stubs (TensorRT itself cannot run here).

How the check is set up, and why:
* tensorrt-stubs (10.13) installs `tensorrt/__init__.pyi` and `tensorrt_bindings/*.pyi` without a
  py.typed marker, and its generated stubs have a few syntax errors (a parameter named `in`,
  parameters without defaults after ones with defaults). The test copies them into a temporary
  stub folder, repairing exactly those two things, and puts that folder on MYPYPATH. Errors inside
  the stubs themselves are ignored; our calls into them are checked.
* `specrt` is an editable install mapped by a finder hook mypy cannot follow, so a temporary
  `specrt/` folder links the repository's export/, plugins/, runtime/ and tools/.
* torch, triton and onnx are not followed (they would make the run minutes long; torch values are
  Any here): the check is about the TensorRT API. `tensorrt.plugin` has no stubs; specrt types the
  part it uses as the PluginAPI protocol (specrt.plugins.trt_api), which mypy checks the calls against.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["specrt.plugins.trt_api", "specrt.plugins.trt_plugins", "specrt.plugins.triton_aot",
           "specrt.export.build", "specrt.runtime.backends.trt_backend"]
CONFIG = """
[mypy]
python_version = {python}
check_untyped_defs = True
follow_imports = silent
namespace_packages = True
explicit_package_bases = True
warn_unused_ignores = True
show_error_codes = True
cache_dir = {cache}

[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True

[mypy-torch,torch.*,triton,triton.*,onnx,onnx.*,onnxscript,onnxscript.*,onnx_ir,onnx_ir.*,onnxruntime,onnxruntime.*]
follow_imports = skip
ignore_missing_imports = True

[mypy-transformers.*,safetensors.*,tokenizers.*,gguf.*,jinja2.*,rich.*,tqdm.*]
follow_imports = skip
ignore_missing_imports = True
"""


def _split_params(text: str) -> list[str]:
    out, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        out.append(current)
    return out


def repair_stub(text: str) -> str:
    """Make the generated stubs parse: rename parameters called `in`, give defaults after defaults."""
    lines = []
    for line in text.splitlines():
        match = re.match(r"^(\s*def \w+\()(.*)(\) -> .*:.*)$", line)
        if match:
            fixed, seen_default = [], False
            for param in _split_params(match.group(2)):
                param = re.sub(r"^in:", "in_:", param.strip())
                if "=" in param:
                    seen_default = True
                elif seen_default and not param.startswith("*"):
                    param += " = ..."
                fixed.append(param)
            line = match.group(1) + ", ".join(fixed) + match.group(3)
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def mypy_env(tmp_path_factory):
    pytest.importorskip("mypy", reason="mypy is not installed (pip install mypy)")
    try:
        files = importlib.metadata.files("tensorrt-stubs") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tensorrt-stubs is not installed (pip install --no-deps tensorrt-stubs)")
    base = tmp_path_factory.mktemp("mypy")
    stubs = base / "stubs"
    copied = 0
    for f in files:
        if f.suffix == ".pyi":
            dest = stubs / f
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(repair_stub(Path(f.locate()).read_text()))
            copied += 1
    if not (stubs / "tensorrt" / "__init__.pyi").is_file():
        pytest.skip("tensorrt-stubs has no tensorrt/__init__.pyi")
    src = base / "src" / "specrt"
    src.mkdir(parents=True)
    for name in ("export", "plugins", "runtime", "tools"):
        (src / name).symlink_to(ROOT / name, target_is_directory=True)
    config = base / "mypy.ini"
    config.write_text(CONFIG.format(python=f"{sys.version_info.major}.{sys.version_info.minor}", cache=base / "cache"))
    env = {**os.environ, "MYPYPATH": f"{base / 'src'}{os.pathsep}{stubs}"}
    return config, env


def run_mypy(config: Path, env: dict, modules: list[str]) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "mypy", "--config-file", str(config)]
    for module in modules:
        args += ["-m", module]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=str(config.parent))


def test_trt_code_type_checks_against_tensorrt_stubs(mypy_env):
    config, env = mypy_env
    result = run_mypy(config, env, MODULES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Success: no issues found in 5 source files" in result.stdout


def test_trt_stubs_catch_a_wrong_tensorrt_call(mypy_env, tmp_path):
    """The check has teeth: a misspelt builder call and a wrong argument type are reported."""
    config, env = mypy_env
    probe = tmp_path / "probe_mod"
    probe.mkdir()
    (probe / "probe.py").write_text(
        "import tensorrt as trt\n\n"
        "def f(logger: trt.ILogger) -> None:\n"
        "    builder = trt.Builder(logger)\n"
        "    builder.create_netwrok(0)\n"
        "    config = builder.create_builder_config()\n"
        "    config.set_flag('FP16')\n"
    )
    env = {**env, "MYPYPATH": env["MYPYPATH"] + os.pathsep + str(probe)}
    result = run_mypy(config, env, ["probe"])
    assert result.returncode == 1
    assert '"Builder" has no attribute "create_netwrok"' in result.stdout, result.stdout[-2000:]
    assert 'Argument 1 to "set_flag" of "IBuilderConfig" has incompatible type "str"' in result.stdout, result.stdout
