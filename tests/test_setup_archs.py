"""setup.py's default CUDA architectures (issue 15, defect 17): PTX of the newest architecture is
always in, so GPUs newer than the compiled ones (Blackwell: B200 sm_100, RTX 50 sm_120) JIT-compile
the kernels instead of failing with "no kernel image is available"."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _default_cuda_archs():
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "default_cuda_archs")
    namespace: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), namespace)  # noqa: S102
    return namespace["default_cuda_archs"]


def test_cuda13_toolkit_gets_blackwell_code_and_ptx():
    listed = "compute_75 compute_80 compute_86 compute_89 compute_90 compute_100 compute_110 compute_120"
    assert _default_cuda_archs()(listed) == "8.0;9.0;10.0;12.0+PTX"


def test_older_toolkit_gets_ptx_of_hopper():
    assert _default_cuda_archs()("compute_70 compute_80 compute_90") == "8.0;9.0+PTX"


def test_unknown_toolkit_still_has_ptx():
    assert _default_cuda_archs()("").endswith("+PTX")
