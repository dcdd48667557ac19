"""setup.py's CUDA architectures: a first build sized to the machine (issue 35) and PTX of the newest
architecture always in, so GPUs newer than the compiled ones (Blackwell: B200 sm_100, RTX 50 sm_120)
JIT-compile the kernels instead of failing with "no kernel image is available" (issue 15)."""

from __future__ import annotations
import __future__

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA13 = "compute_75 compute_80 compute_86 compute_89 compute_90 compute_100 compute_110 compute_120"


def _setup_function(name: str):
    tree = ast.parse((ROOT / "setup.py").read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "NO_GPU_ARCHS"]  # type: ignore[attr-defined]
    nodes += [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict = {}
    # setup.py's annotations are strings (from __future__ import annotations): compiled the same way.
    code = compile(ast.Module(body=nodes, type_ignores=[]), "setup.py", "exec", flags=__future__.annotations.compiler_flag)
    exec(code, namespace)  # noqa: S102
    return namespace[name]


def test_without_a_visible_gpu_one_architecture_is_built():
    default = _setup_function("default_cuda_archs")
    assert default(CUDA13, []) == "9.0+PTX"
    assert default("", []) == "9.0+PTX"


def test_visible_gpus_get_their_own_architectures_and_ptx_of_the_newest():
    default = _setup_function("default_cuda_archs")
    assert default(CUDA13, [(9, 0)]) == "9.0+PTX"
    assert default(CUDA13, [(9, 0), (8, 0), (9, 0)]) == "8.0;9.0+PTX"
    assert default(CUDA13, [(10, 0), (8, 6)]) == "8.6;10.0+PTX"
    # A GPU newer than the toolkit: the ones it knows; none known: the one-architecture default.
    assert default("compute_80 compute_90", [(8, 0), (12, 0)]) == "8.0+PTX"
    assert default("compute_80 compute_90", [(12, 0)]) == "9.0+PTX"


def test_the_portable_set_has_blackwell_code_and_ptx_where_the_toolkit_knows_it():
    portable = _setup_function("portable_cuda_archs")
    assert portable(CUDA13) == "8.0;9.0;10.0;12.0+PTX"
    assert portable("compute_70 compute_80 compute_90") == "8.0;9.0+PTX"
    assert portable("").endswith("+PTX")


def test_the_quickstart_benchmark_builds_cpu_only_without_a_gpu_unless_cuda_is_asked_for():
    """scripts/bench.sh's rule (Note [First-build time]): with no GPU visible its benchmark is CPU-only,
    so its first build skips the CUDA part; anything that asks for CUDA keeps it."""
    cpu_only = _setup_function("quickstart_cpu_only")
    bench = {"RINGREDUCE_CPU_WITHOUT_GPU": "1"}
    assert cpu_only(bench, [], cuda_built_here=False)
    assert not cpu_only({}, [], cuda_built_here=False)  # pip install, scripts/test.sh, CI
    assert not cpu_only(bench, [(9, 0)], cuda_built_here=False)  # a GPU here: the benchmark uses it
    assert not cpu_only({**bench, "TORCH_CUDA_ARCH_LIST": "9.0"}, [], cuda_built_here=False)  # a login node
    assert not cpu_only({**bench, "RINGREDUCE_REQUIRE_CUDA": "1"}, [], cuda_built_here=False)
    assert not cpu_only(bench, [], cuda_built_here=True)  # an existing CUDA build only rebuilds what changed


def test_bench_sh_asks_for_the_rule_and_test_sh_does_not():
    bench = (ROOT / "scripts" / "bench.sh").read_text()
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert "RINGREDUCE_CPU_WITHOUT_GPU=1" in bench and "RINGREDUCE_CPU_WITHOUT_GPU" not in test


def test_readme_states_the_rule_in_the_quickstart_block():
    """The rule a newcomer needs before the first build (issue 35): in the Quickstart's code block,
    not in prose after it."""
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    block = quickstart[quickstart.index("```"):quickstart.index("```", quickstart.index("```") + 3)]
    assert "TORCH_CUDA_ARCH_LIST" in block and "9.0+PTX" in block
