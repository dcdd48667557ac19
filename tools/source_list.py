"""The groups of csrc/sources.cmake, the one list of ringreduce's C++ and CUDA sources, for the Python
side of the build (setup.py) and the tests (tests/test_cuda_logic.py, tests/tools/test_source_list.py).
CMake includes the file itself. Loaded by path: the ringreduce package needs the extension built."""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = Path("csrc") / "sources.cmake"
_SET = re.compile(r"^set\(RR_SOURCES_(\w+)\s+(.*?)\)", re.M | re.S)


def groups(root: str | Path) -> dict[str, list[str]]:
    """{group: [path from the repository root, ...]} in the manifest's order; ValueError for a file
    that is listed twice or does not exist."""
    root = Path(root)
    text = "\n".join(line.split("#", 1)[0] for line in (root / MANIFEST).read_text().splitlines())
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for name, body in _SET.findall(text):
        out[name] = body.split()
        for path in out[name]:
            if path in seen:
                raise ValueError(f"{MANIFEST}: {path} is listed twice")
            if not (root / path).is_file():
                raise ValueError(f"{MANIFEST}: {path} (group {name}) does not exist")
            seen.add(path)
    return out


def sources(root: str | Path, *names: str) -> list[str]:
    """The files of the groups `names`, in that order; KeyError names a group the manifest lacks."""
    listed = groups(root)
    missing = [n for n in names if n not in listed]
    if missing:
        raise KeyError(f"{MANIFEST} has no group {missing} (it has {sorted(listed)})")
    return [path for n in names for path in listed[n]]
