"""csrc/sources.cmake is the one list of the extension's sources (tools/source_list.py reads it for
setup.py and the tests; CMake includes it): every .cpp and .cu under csrc/ is in exactly one group,
and no build file names a source itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import source_list

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ["core", "cpu", "cpu_torch", "torch", "torch_cuda", "cuda_logic", "cuda_runtime", "cuda_device"]


def test_every_source_is_in_one_group():
    listed = source_list.groups(ROOT)
    assert list(listed) == GROUPS
    on_disk = sorted(str(p.relative_to(ROOT)) for ext in ("cpp", "cu") for p in (ROOT / "csrc").rglob(f"*.{ext}"))
    assert sorted(p for paths in listed.values() for p in paths) == on_disk


SOURCE = re.compile(r"csrc/\w+/\w+\.(?:cpp|cu)\b")


def test_no_build_file_lists_a_source():
    """CMake's targets take the groups (${RR_SOURCES_...}); setup.py and the GPU-logic test name groups.
    Outside comments, setup.py names sources only in HEAVY_FIRST (the compile order, Note [First-build
    time]), each of them listed in the manifest."""
    listed = {p for paths in source_list.groups(ROOT).values() for p in paths}
    for build_file in ("CMakeLists.txt", "csrc/cuda/CMakeLists.txt", "setup.py", "tests/test_cuda_logic.py"):
        code = "\n".join(line.split("#", 1)[0] for line in (ROOT / build_file).read_text().splitlines())
        if build_file.endswith(".py"):  # its code, not its docstrings
            tree = ast.parse(code)
            code = "\n".join(ast.get_source_segment(code, node) or "" for node in tree.body
                              if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)))
        if build_file == "setup.py":
            heavy = re.search(r"^HEAVY_FIRST = \((.*?)\)$", code, re.M | re.S)
            assert heavy, "setup.py has no HEAVY_FIRST = (...)"
            assert set(SOURCE.findall(heavy.group(1))) <= listed
            code = code.replace(heavy.group(0), "")
        named = SOURCE.findall(code)
        assert not named, f"{build_file} names sources of csrc/ itself: {named} (list them in csrc/sources.cmake)"


def test_a_bad_manifest_is_refused(tmp_path):
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    (tmp_path / "csrc" / "core" / "a.cpp").write_text("")
    manifest = tmp_path / "csrc" / "sources.cmake"
    manifest.write_text("set(RR_SOURCES_core\n  csrc/core/a.cpp  # one\n  csrc/core/a.cpp\n)\n")
    with pytest.raises(ValueError, match="listed twice"):
        source_list.groups(tmp_path)
    manifest.write_text("set(RR_SOURCES_core\n  csrc/core/b.cpp\n)\n")
    with pytest.raises(ValueError, match="b.cpp .group core. does not exist"):
        source_list.groups(tmp_path)
    manifest.write_text("set(RR_SOURCES_core csrc/core/a.cpp)\n")
    assert source_list.sources(tmp_path, "core") == ["csrc/core/a.cpp"]
    with pytest.raises(KeyError, match="no group"):
        source_list.sources(tmp_path, "cuda_device")
