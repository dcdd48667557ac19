"""The default run (`bash scripts/test.sh`: every test not marked `full`, tests/README.md "The default
run") covers every behaviour at least once, or this fails naming what it misses:

* every public function and class of ringreduce, ringreduce.functional and ringreduce.nn, and every
  public method and property of the public classes, is referred to by the code a default test runs
  (the test function and the module-level functions and classes it reaches, its rank bodies included);
* every test docs/reliability.md names as the proof of a failure mode (every error path) has a case in
  the default run;
* every test module has a case in it, and every module that runs at the place "tcp" (Note [Places])
  has a tcp case in it, as it has a shm one.

Which tests are in the default run is what pytest collects with the marker expression that
scripts/test.sh passes (read from there: written once); in the default run itself this test reads the
session's own selection instead of collecting again.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import ringreduce
import ringreduce.functional
import ringreduce.nn

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PUBLIC_MODULES = {"ringreduce": ringreduce, "ringreduce.functional": ringreduce.functional,
                  "ringreduce.nn": ringreduce.nn}
# Public methods that torch calls, not the user: each is used where a test uses what calls it.
CALLED_BY_TORCH = {
    "ringreduce.GradientAverager.join_hook": "Join",  # torch.distributed.algorithms.Join([averager])
    "ringreduce.BackendOptions.from_pg_options": "pg_options",  # the backend's creator: new_group(pg_options=)
}
CALLERS = set(CALLED_BY_TORCH.values())


def default_markexpr() -> str:
    """The marker expression of scripts/test.sh's DEFAULT_SET=(-m "...")."""
    text = (ROOT / "scripts" / "test.sh").read_text()
    m = re.search(r"^DEFAULT_SET=\((.*)\)$", text, re.M)
    assert m, "scripts/test.sh has no DEFAULT_SET=(...) line"
    words = shlex.split(m.group(1))
    assert words[0] == "-m" and len(words) == 2, words
    return words[1]


def default_node_ids(request) -> list[str]:
    """The node ids of the default run that run without a GPU (the GPU tests, marked gpu, skip here and
    cover nothing on this machine)."""
    whole = {Path(a).resolve() for a in request.config.args} in ({TESTS}, {ROOT})
    if os.environ.get("RINGREDUCE_TEST_SET") == "default" and whole:
        return [item.nodeid for item in request.session.items if item.get_closest_marker("gpu") is None]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", f"({default_markexpr()}) and not gpu", str(TESTS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def default_ids(request) -> list[str]:
    return default_node_ids(request)


# ---- what a test's code refers to ---------------------------------------------------------------------


class _Module:
    """One test module's module-level functions and classes, what each refers to, and its aliases of
    ringreduce's public modules."""

    def __init__(self, path: Path) -> None:
        tree = ast.parse(path.read_text())
        self.defs: dict[str, ast.AST] = {}
        self.aliases: dict[str, str] = {}  # local name -> public module ("rr" -> "ringreduce")
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (public module, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in PUBLIC_MODULES:
                        self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "ringreduce"
            elif isinstance(node, ast.ImportFrom) and node.module in PUBLIC_MODULES:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in PUBLIC_MODULES:
                        self.aliases[a.asname or a.name] = full
                    else:
                        self.imported[a.asname or a.name] = (node.module, a.name)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
        self.module_level = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                         ast.ClassDef))]

    def _chain(self, node: ast.AST) -> str | None:
        """'ringreduce.nn' for rr.nn (a public module reached through an alias), else None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._chain(node.value)
            if base is not None and f"{base}.{node.attr}" in PUBLIC_MODULES:
                return f"{base}.{node.attr}"
        return None

    def references(self, roots: list[str]) -> tuple[set[tuple[str, str]], set[str]]:
        """(public module, name) pairs and attribute names the code reachable from `roots` refers to."""
        public: set[tuple[str, str]] = set()
        attrs: set[str] = set()
        seen: set[str] = set()
        todo = list(roots)
        nodes: list[ast.AST] = list(self.module_level)  # parameter lists, constants
        while todo:
            name = todo.pop()
            if name in seen or name not in self.defs:
                continue
            seen.add(name)
            nodes.append(self.defs[name])
            for n in ast.walk(self.defs[name]):
                if isinstance(n, ast.Name) and n.id in self.defs:
                    todo.append(n.id)
        for root in nodes:
            for n in ast.walk(root):
                if isinstance(n, ast.Attribute):
                    attrs.add(n.attr)
                    base = self._chain(n.value)
                    if base is not None:
                        public.add((base, n.attr))
                elif isinstance(n, ast.Name) and n.id in self.imported:
                    public.add(self.imported[n.id])
                elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
                    attrs.add(n.value)  # getattr(obj, "name"), parametrized method names
                elif isinstance(n, ast.keyword) and n.arg is not None:
                    attrs.add(n.arg)  # f(pg_options=...)
                elif isinstance(n, ast.Name) and n.id in CALLERS:
                    attrs.add(n.id)  # Join(...)
        return public, attrs


def _default_functions(ids: list[str]) -> dict[Path, list[str]]:
    """Test file -> the test functions (and classes) with a case in the default run."""
    out: dict[Path, list[str]] = {}
    for nodeid in ids:
        file, _, rest = nodeid.partition("::")
        name = rest.split("[")[0].split("::")[0]
        out.setdefault(ROOT / file, []).append(name)
    return out


def _public_api() -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    """(module, name) of every public function and class, and each public class's own public methods
    and properties."""
    names = {(mod, n) for mod, m in PUBLIC_MODULES.items() for n in m.__all__
             if f"{mod}.{n}" not in PUBLIC_MODULES}
    methods: dict[str, set[str]] = {}
    for mod, n in names:
        obj = getattr(PUBLIC_MODULES[mod], n)
        if inspect.isclass(obj) and obj.__module__.startswith("ringreduce"):
            own = {k for k, v in vars(obj).items() if not k.startswith("_")
                   and (callable(v) or isinstance(v, (property, staticmethod, classmethod))
                        or hasattr(v, "__wrapped__"))}
            if issubclass(obj, BaseException) or not own:
                continue
            methods[f"{mod}.{n}"] = own
    return names, methods


def missing_api(ids: list[str]) -> list[str]:
    """The public functions, classes, methods and properties no test among `ids` refers to."""
    referred: set[tuple[str, str]] = set()
    attrs: set[str] = set()
    for path, functions in _default_functions(ids).items():
        public, names = _Module(path).references(functions)
        referred |= public
        attrs |= names
    functions, methods = _public_api()
    # a name re-exported by another public module (functional.ReduceOp is ringreduce.ReduceOp) is one
    referred_objects = {id(getattr(PUBLIC_MODULES[mod], n)) for mod, n in referred
                        if mod in PUBLIC_MODULES and hasattr(PUBLIC_MODULES[mod], n)}
    missing = sorted(f"{mod}.{n}" for mod, n in functions if id(getattr(PUBLIC_MODULES[mod], n)) not in referred_objects)
    return missing + sorted(f"{cls}.{m}" for cls, own in methods.items() for m in own
                            if m not in attrs and CALLED_BY_TORCH.get(f"{cls}.{m}") not in attrs)


def missing_error_paths(ids: list[str]) -> list[str]:
    """The tests docs/reliability.md names as proofs of failure modes that have no case among `ids`."""
    named = sorted(set(re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", (ROOT / "docs" / "reliability.md").read_text())))
    assert len(named) >= 20, named  # the doc's tables name their tests so
    have = {(nodeid.partition("::")[0], nodeid.partition("::")[2].split("[")[0]) for nodeid in ids}
    return [f"{f}::{t}" for f, t in named if (f, t) not in have]


def missing_modules_and_places(ids: list[str]) -> list[str]:
    """Test modules (outside tests/gpu) with no case among `ids`, and modules at the CPU places with no
    case at one of them."""
    modules = sorted(p.relative_to(ROOT).as_posix() for p in TESTS.rglob("test_*.py") if "gpu" not in p.parent.name)
    by_module: dict[str, list[str]] = {}
    for nodeid in ids:
        by_module.setdefault(nodeid.partition("::")[0], []).append(nodeid)
    out = [f"{m}: no case" for m in modules if m not in by_module]
    for module in modules:
        if module in by_module and re.search(r"^PLACES = (CPU_PLACES|ALL_PLACES)", (ROOT / module).read_text(), re.M):
            out += [f"{module}: no case at {place}" for place in ("shm", "tcp")
                    if not any(f"[{place}" in i for i in by_module[module])]
    return out


def test_every_public_function_and_method_is_used_by_a_default_test(default_ids):
    missing = missing_api(default_ids)
    assert not missing, f"public names, methods and properties no default test refers to: {missing}"


def test_every_error_path_of_docs_reliability_runs_by_default(default_ids):
    missing = missing_error_paths(default_ids)
    assert not missing, f"failure modes of docs/reliability.md whose test is not in the default run: {missing}"


def test_every_module_and_both_cpu_places_run_by_default(default_ids):
    missing = missing_modules_and_places(default_ids)
    assert not missing, f"not in the default run: {missing}"


def test_the_checks_see_what_a_smaller_run_misses(default_ids):
    """The three checks fail where they should: a run of tests/test_errors.py's shm cases alone misses
    public functions (the hooks, the collectives' other halves), error paths of other modules, modules
    and the tcp place."""
    errors_only = [i for i in default_ids if i.startswith("tests/test_errors.py::") and "[tcp" not in i]
    assert errors_only
    api = missing_api(errors_only)
    assert "ringreduce.GradientAverager" in api and "ringreduce.ddp_comm_hook" in api, api
    assert "tests/test_concurrency.py::test_gil_is_released_while_a_call_blocks" in missing_error_paths(errors_only)
    gaps = missing_modules_and_places(errors_only)
    assert "tests/test_hooks.py: no case" in gaps and "tests/test_errors.py: no case at tcp" in gaps, gaps
