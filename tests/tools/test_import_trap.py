"""`import ringreduce` from inside a clone (issue 35): the working directory comes first on sys.path, so
a clone's ringreduce/ folder is what Python imports. Unbuilt, with a built ringreduce installed
elsewhere, the error names the shadowing as such (both folders, and what to do); with none installed
it says how to build. From the folder that holds a clone named ringreduce, the installed package wins
(a folder without __init__.py is only a namespace portion), so the clone's root needs no __init__.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringreduce

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(ringreduce.__file__).resolve().parent
TORCH_SITE = str(Path(torch.__file__).resolve().parent.parent)


def _unbuilt_clone(root: Path) -> Path:
    """root/ringreduce: the package's Python sources without the compiled extension (a fresh clone)."""
    shutil.copytree(PACKAGE, root / "ringreduce", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return root / "ringreduce"


def _python(code: str, cwd: Path, extra_path: list[str]) -> subprocess.CompletedProcess:
    """Python without site-packages (-S: no installed ringreduce, no .pth files) on the working
    directory, then `extra_path` (torch's site folder, and whatever plays the installed package)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    prelude = f"import sys; sys.path[1:] = {extra_path!r} + sys.path[1:]; "
    return subprocess.run([sys.executable, "-S", "-c", prelude + code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.full
def test_an_unbuilt_clone_shadowing_an_installed_package_is_named_as_such(tmp_path) -> None:
    clone = tmp_path / "clone"
    sources = _unbuilt_clone(clone)
    proc = _python("import ringreduce", clone, [str(REPO), TORCH_SITE])  # REPO plays the installed package
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: import ringreduce found "), proc.stderr
    assert f"found {sources}, a source folder without a build" in last
    assert f"ahead of the ringreduce installed at {PACKAGE}, which it shadows" in last
    assert f"Run Python from another folder than {clone}" in last
    assert "circular import" not in last


def test_an_unbuilt_clone_alone_says_how_to_build(tmp_path) -> None:
    clone = tmp_path / "clone"
    sources = _unbuilt_clone(clone)
    proc = _python("import ringreduce", clone, [TORCH_SITE])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert f"ringreduce._C is missing or failed to load from {sources}" in last, proc.stderr
    assert "shadows" not in last
    assert f"pip install -v --no-build-isolation {clone}" in last


@pytest.mark.full
def test_the_folder_holding_a_clone_named_ringreduce_imports_the_installed_package(tmp_path) -> None:
    clone = tmp_path / "ringreduce"
    _unbuilt_clone(clone)
    proc = _python("import ringreduce; print(ringreduce.__file__); print(ringreduce.all_reduce_avg.__name__)",
                   tmp_path, [str(REPO), TORCH_SITE])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(REPO / "ringreduce" / "__init__.py"), "all_reduce_avg"]


def test_the_repository_root_is_not_a_package() -> None:
    assert not (REPO / "__init__.py").exists()
