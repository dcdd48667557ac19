"""Loads ringreduce._C and checks it was built against the torch that is running.

Where the extension is missing, the error says why: most often Python imported a source folder (a
clone's ringreduce/, found first because the working directory or PYTHONPATH holds the clone) that
has no build, while a built ringreduce is installed elsewhere and is shadowed by it."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys

import torch

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def shadowed_install(package_dir: str = _PACKAGE, path: list[str] | None = None) -> str | None:
    """The folder of another ringreduce package that `import ringreduce` would have found on `path`
    (default sys.path) without the entry that holds `package_dir`, or None when there is none."""
    holder = os.path.realpath(os.path.dirname(package_dir))
    rest = [p for p in (sys.path if path is None else path) if os.path.realpath(p or os.curdir) != holder]
    spec = importlib.machinery.PathFinder.find_spec("ringreduce", rest)
    if spec is None or not spec.origin or spec.origin in ("namespace", None):
        return None
    found = os.path.dirname(os.path.realpath(spec.origin))
    return None if found == os.path.realpath(package_dir) else found


def missing_extension_message(exc: BaseException, package_dir: str = _PACKAGE, path: list[str] | None = None) -> str:
    """What to say when ringreduce._C cannot be imported from `package_dir` (the error `exc`)."""
    other = shadowed_install(package_dir, path)
    holder = os.path.dirname(package_dir)
    if other is not None:
        return (f"import ringreduce found {package_dir}, a source folder without a build of ringreduce._C, "
                f"ahead of the ringreduce installed at {other}, which it shadows: {holder} comes first on "
                "sys.path (the working directory, or PYTHONPATH). Run Python from another folder than "
                f"{holder}, or build this source tree in place (`python setup.py build_ext --inplace` in "
                f"{holder}) to use it instead. ({exc})")
    return (f"ringreduce's native extension ringreduce._C is missing or failed to load from {package_dir} "
            f"({exc}). Build it: `pip install -v --no-build-isolation {holder}` (needs torch, ninja and numpy "
            f"installed), or `bash {holder}/scripts/test.sh` from a clone (it sets up .venv and builds in place).")


try:
    _C = importlib.import_module("ringreduce._C")
except ImportError as exc:  # depends on the install
    raise ImportError(missing_extension_message(exc)) from exc

_built = _C.native_info["torch_built"]
if _built.split("+")[0] != torch.__version__.split("+")[0]:
    raise ImportError(
        f"ringreduce was built against torch {_built} but torch {torch.__version__} is running; "
        "rebuild it with `pip install --no-build-isolation --force-reinstall --no-deps .`"
    )

C = _C
