"""`import ringreduce` from the folder that holds a clone named ringreduce (the clone's root __init__.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import ringreduce

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(ringreduce.__file__).resolve().parent


def _clone_named_ringreduce(tmp_path: Path, marker: bool = True) -> Path:
    """tmp_path/ringreduce: a clone-like tree (its root __init__.py and the package as ringreduce/)."""
    clone = tmp_path / "ringreduce"
    clone.mkdir()
    if marker:
        shutil.copy(REPO / "__init__.py", clone / "__init__.py")
    (clone / "ringreduce").symlink_to(PACKAGE, target_is_directory=True)
    return clone


def _python(args: list[str], cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_parent_folder_imports_the_installed_package(tmp_path) -> None:
    # The clone's editable install puts the clone's root on sys.path; the working directory comes first.
    clone = _clone_named_ringreduce(tmp_path)
    proc = _python(["-c", "import ringreduce; print(ringreduce.__file__); print(ringreduce.all_reduce_avg.__name__)"],
                   tmp_path, str(clone))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(clone / "ringreduce" / "__init__.py"), "all_reduce_avg"]


def test_without_an_installed_package_the_error_says_what_happened(tmp_path) -> None:
    clone = _clone_named_ringreduce(tmp_path)
    # -S: no site-packages, so no installed ringreduce (nor torch) can be found.
    proc = _python(["-S", "-c", "import ringreduce"], tmp_path, None)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "a ringreduce source tree, not the package" in proc.stderr
    assert f"bash {clone}/scripts/test.sh" in proc.stderr


def test_without_the_root_marker_the_clone_is_an_empty_namespace(tmp_path) -> None:
    # What the marker prevents: the clone imported as a namespace package, no error until first use.
    _clone_named_ringreduce(tmp_path, marker=False)
    proc = _python(["-S", "-c", "import ringreduce; ringreduce.all_reduce"], tmp_path, None)
    assert "AttributeError: module 'ringreduce' has no attribute 'all_reduce'" in proc.stderr
