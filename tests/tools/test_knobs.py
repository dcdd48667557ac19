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


# Out-of-range values (audit finding 9): refused by name when read, as 'abc' and -5 are, instead of
# reaching the native CallOptions, whose fields (int64/int32) would raise a TypeError naming no knob.
_OUT_OF_RANGE = [
    ("RINGREDUCE_SEGMENT_BYTES", str(1 << 63), "RINGREDUCE_SEGMENT_BYTES=9223372036854775808 must be <= 9223372036854775807"),
    ("RINGREDUCE_SLOTS", str(1 << 31), "RINGREDUCE_SLOTS=2147483648 must be <= 2147483647"),
    ("RINGREDUCE_ONESHOT_BYTES", str(1 << 64), "RINGREDUCE_ONESHOT_BYTES=18446744073709551616 must be <= 9223372036854775807"),
    ("RINGREDUCE_LANES", "5", "RINGREDUCE_LANES=5 must be <= 4"),
    ("RINGREDUCE_LOCAL_SIZE", str(1 << 31), "RINGREDUCE_LOCAL_SIZE must be a positive integer of at most 2147483647"),
    ("RINGREDUCE_TIMEOUT", "1e30", "RINGREDUCE_TIMEOUT='1e30' must be <= 1e+09 seconds"),
    ("RINGREDUCE_TIMEOUT", "1000000001", "RINGREDUCE_TIMEOUT='1000000001' must be <= 1e+09 seconds"),
    ("RINGREDUCE_TIMEOUT", "nan", "RINGREDUCE_TIMEOUT='nan' must be a finite number of seconds"),
    ("RINGREDUCE_TIMEOUT", "inf", "RINGREDUCE_TIMEOUT='inf' must be a finite number of seconds"),
    ("RINGREDUCE_TIMEOUT", "-inf", "RINGREDUCE_TIMEOUT='-inf' must be a finite number of seconds"),
]


@pytest.mark.parametrize(("name", "value", "message"), _OUT_OF_RANGE, ids=[f"{n}={v}" for n, v, _ in _OUT_OF_RANGE])
def test_out_of_range_knobs_are_refused_by_name(monkeypatch, name, value, message):
    for knob in _config.KNOBS:
        monkeypatch.delenv(knob.name, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        _config.read()
    assert message in str(info.value)


def test_the_largest_accepted_knobs_fit_the_native_fields(monkeypatch):
    """The bounds are the native fields' ranges: the largest accepted values reach CallOptions, one
    more would not (pybind's TypeError)."""
    from ringreduce._native import C

    for knob in _config.KNOBS:
        monkeypatch.delenv(knob.name, raising=False)
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", str(_config.INT64_MAX))
    monkeypatch.setenv("RINGREDUCE_SLOTS", str(_config.INT32_MAX))
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", str(_config.INT64_MAX))
    monkeypatch.setenv("RINGREDUCE_LANES", "4")
    monkeypatch.setenv("RINGREDUCE_LOCAL_SIZE", str(_config.INT32_MAX))
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "1e9")
    knobs = _config.read()
    assert (knobs.segment_bytes, knobs.num_slots, knobs.one_shot_bytes, knobs.lanes, knobs.local_size,
            knobs.timeout_ms) == ((1 << 63) - 1, (1 << 31) - 1, (1 << 63) - 1, 4, (1 << 31) - 1, 10**12)
    o = C.CallOptions()
    o.segment_bytes, o.one_shot_bytes, o.timeout_ms = knobs.segment_bytes, knobs.one_shot_bytes, knobs.timeout_ms
    o.num_slots, o.lanes, o.local_size = knobs.num_slots, knobs.lanes, knobs.local_size
    assert (o.segment_bytes, o.num_slots, o.timeout_ms, o.local_size) == (
        knobs.segment_bytes, knobs.num_slots, knobs.timeout_ms, knobs.local_size)
    for field, value in (("segment_bytes", 1 << 63), ("num_slots", 1 << 31), ("local_size", 1 << 31)):
        with pytest.raises(TypeError):
            setattr(o, field, value)
