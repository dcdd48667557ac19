"""The build refuses an extension that carries its own copy of libstdc++ (Note [One libstdc++ per
process], tools/libstdcxx_check.py): the verdict on small libraries linked with and without
-static-libstdc++, the real extension as built, and setup.py itself relinking the real extension's
objects with LDFLAGS=-static-libstdc++ (no compile: the objects in build-ext are reused)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ringreduce
from ringreduce._native import C

ROOT = Path(__file__).resolve().parents[2]
SOURCE = r"""
#include <sstream>
#include <string>
extern "C" const char* rr_format(long v) {
  static std::string s;
  std::ostringstream o;
  o << "call #" << v << " done";
  s = o.str();
  return s.c_str();
}
"""


def _module():
    spec = importlib.util.spec_from_file_location("libstdcxx_check", ROOT / "tools" / "libstdcxx_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _module()
CXX = os.environ.get("CXX") or shutil.which("g++") or "c++"


@pytest.fixture(scope="module")
def small_libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("libstdcxx")
    (d / "fmt.cpp").write_text(SOURCE)
    libs = {}
    for name, flags in (("shared", []), ("static", ["-static-libstdc++"])):
        out = d / f"fmt_{name}.so"
        subprocess.run([CXX, "-O1", "-fPIC", "-shared", str(d / "fmt.cpp"), *flags, "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        libs[name] = str(out)
    return libs


def test_small_library_verdicts(small_libs):
    ok = check.check(small_libs["shared"])
    assert ok.ok and check.LIBSTDCXX in ok.needed and not ok.locale_symbols, ok
    bad = check.check(small_libs["static"])
    assert not bad.ok
    assert check.LIBSTDCXX not in bad.needed
    assert any(s.startswith("_ZNSt6locale") for s in bad.locale_symbols), bad
    assert "_ZNSt6locale2id11_S_refcountE" in check.read_dynamic(small_libs["static"])[1]
    assert len(bad.problems) == 2


def test_needed_list_matches_readelf(small_libs):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not installed: the cross-check needs it")
    for path in (small_libs["shared"], C.__file__):
        out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
        want = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
        assert check.read_dynamic(path)[0] == want


def test_the_built_extension_passes():
    verdict = check.check(C.__file__)
    assert verdict.ok, verdict.problems


def test_not_an_elf_file(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(check.ElfError, match="not an ELF file"):
        check.check(str(p))


def test_cause_and_fix_name_the_flag_or_the_compiler(tmp_path):
    cause, fix = check.cause_and_fix(["g++", "-shared", "-static-libstdc++"], "-O2 -static-libstdc++", [])
    assert cause == "the flag -static-libstdc++ in LDFLAGS" and "remove -static-libstdc++" in fix
    cause, _ = check.cause_and_fix(["g++", "-shared", "-static-libstdc++"], "", [])
    assert cause.startswith("the flag -static-libstdc++ on the link command")
    fake = tmp_path / "toolchain" / "bin" / "g++"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'g++ (Toolchain GCC) 13.2.0'\n")
    fake.chmod(0o755)
    system = tmp_path / "usr" / "bin" / "g++"
    system.parent.mkdir(parents=True)
    system.write_text("")
    cause, fix = check.cause_and_fix([str(fake), "-shared"], "", [], system_cxx=str(system))
    assert cause.startswith(f"the C++ compiler {fake} (g++ (Toolchain GCC) 13.2.0)"), cause
    assert f"CXX={system}" in fix, fix
    _, fix = check.cause_and_fix([str(fake), "-shared"], "", [], system_cxx=str(fake))  # it is the system's
    assert "CXX=" not in fix and "set CXX and CC" in fix


def test_enforce_deletes_and_stops(small_libs, tmp_path):
    target = tmp_path / "copy.so"
    shutil.copy(small_libs["static"], target)
    with pytest.raises(SystemExit) as info:
        check.enforce(str(target), ["g++", "-shared"], "-static-libstdc++")
    assert not target.exists()
    msg = str(info.value)
    assert "Cause: the flag -static-libstdc++ in LDFLAGS" in msg and "The file was deleted" in msg, msg
    assert check.enforce(small_libs["shared"], ["g++", "-shared"]).ok


def _build_env() -> dict:
    """The environment of the build that made this checkout's extension (so that ninja finds every
    object up to date and only the link runs)."""
    info = ringreduce.build_info()
    env = dict(os.environ, LDFLAGS="-static-libstdc++", PYTHONPATH=str(ROOT))
    if info["cuda"]:
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(info["cuda_archs"])
        env.pop("RINGREDUCE_FORCE_CPU", None)
    else:
        env["RINGREDUCE_FORCE_CPU"] = "1"
    return env


def test_setup_refuses_the_extension_relinked_with_static_libstdcxx(tmp_path):
    """setup.py build_ext relinks the real extension's objects (build-ext) with -static-libstdc++:
    the build fails, says why and how to fix it, and leaves no extension behind."""
    assert any((ROOT / "build-ext").rglob("*.o")), "build-ext holds no objects: build ringreduce first"
    out = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(out)], cwd=ROOT,
                          env=_build_env(), capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "-static-libstdc++" in text.split("refusing the extension just linked")[0], "it did not link"
    assert "refusing the extension just linked" in text, text[-3000:]
    assert "Cause: the flag -static-libstdc++ in LDFLAGS" in text and "The file was deleted" in text, text[-3000:]
    assert not list(out.rglob("_C*.so")), "the refused extension was left behind"
