"""The knobs are declared once (ringreduce._config.KNOBS): README's table is that declaration, and every
RINGREDUCE_* variable the library's sources name is declared there (or is a build/test variable)."""

from __future__ import annotations

import os
import re

import pytest

from ringreduce import _config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Read by setup.py (build) and by the GPU test harness / gpu_check (tests), not by the library at run time.
NOT_RUNTIME = {"RINGREDUCE_FORCE_CPU", "RINGREDUCE_REQUIRE_CUDA", "RINGREDUCE_GPU_WORLD", "RINGREDUCE_GPU_DEADLINE"}


def _source_names() -> dict[str, str]:
    texts: dict[str, str] = {}
    for top in ("ringreduce", "csrc"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".py", ".h", ".cpp", ".cu", ".cuh")):
                    path = os.path.join(folder, f)
                    with open(path, encoding="utf-8") as fh:
                        texts[os.path.relpath(path, ROOT)] = fh.read()
    # Python constants named RINGREDUCE_* (e.g. the bench's column names) are not variables.
    constants = {n for text in texts.values() for n in re.findall(r"^(RINGREDUCE_\w+) *=", text, re.M)}
    names: dict[str, str] = {}
    for where, text in texts.items():
        for name in re.findall(r"\bRINGREDUCE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text):
            if name not in constants:
                names.setdefault(name, where)
    return names


def test_readme_table_is_the_declaration():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    table = _config.knobs_markdown()
    assert table in readme, "README's Knobs table differs from ringreduce._config.KNOBS; paste knobs_markdown()"


def test_every_variable_the_sources_name_is_declared():
    declared = {k.name for k in _config.KNOBS}
    undeclared = {n: where for n, where in _source_names().items() if n not in declared | NOT_RUNTIME}
    assert not undeclared, f"RINGREDUCE_* variables named in the sources but not in KNOBS: {undeclared}"


def test_declared_once_and_documented():
    names = [k.name for k in _config.KNOBS]
    assert len(names) == len(set(names))
    for k in _config.KNOBS:
        assert k.name.startswith("RINGREDUCE_") and k.default and k.meaning, k


@pytest.mark.parametrize("value", ["x", "0", "-3"])
def test_local_size_is_read_and_checked_in_one_place(monkeypatch, value):
    monkeypatch.setenv("RINGREDUCE_LOCAL_SIZE", value)
    with pytest.raises(ValueError, match="RINGREDUCE_LOCAL_SIZE"):
        _config.local_size_override()


def test_local_size_unset_and_set(monkeypatch):
    monkeypatch.delenv("RINGREDUCE_LOCAL_SIZE", raising=False)
    assert _config.local_size_override() is None
    monkeypatch.setenv("RINGREDUCE_LOCAL_SIZE", "3")
    assert _config.local_size_override() == 3
