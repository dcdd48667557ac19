"""Does a linked extension use the process's shared libstdc++? (setup.py runs this right after linking.)

Note [One libstdc++ per process]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ringreduce._C is loaded into a Python process where torch has already loaded the shared
libstdc++.so.6. An extension linked with its own static copy of libstdc++ (``-static-libstdc++``,
or a toolchain whose g++ does that by default: some HPC modules, conda compilers, devtoolsets) then
holds a second copy of the C++ runtime, and the two copies mix: the locale facet ids of the stream
templates (``std::num_put<char>::id`` and friends, GNU-unique symbols) bind to the copy already
loaded, while the extension's own ``std::locale`` keeps its own id counter and classic locale. Any
``<< integer`` into a stream then picks the wrong facet: g++ 12's ``use_facet`` fails a dynamic_cast
and the text silently loses the number, g++ >= 13 crashes with SIGSEGV (first seen on a GPU machine,
in the agreement check's mismatch message). Rewriting one message fixes nothing; an extension built
that way must never be installed. So the build checks the ELF file it linked:

* its dynamic section must list ``libstdc++.so.6`` as NEEDED (the process's shared C++ runtime), and
* its dynamic symbol table must define none of ``std::locale``'s members (``_ZNSt6locale*``, e.g.
  ``_ZNSt6locale2id11_S_refcountE``), which only a copy of libstdc++ itself defines.

``check(path)`` is a pure function of the file (ELF parsed here, no readelf needed);
``enforce(...)`` deletes a refused file and stops the build with a message that names the cause
(the flag or the compiler) and the fix.
"""

from __future__ import annotations

import os
import shlex
import shutil
import struct
import subprocess
from dataclasses import dataclass, field

LIBSTDCXX = "libstdc++.so.6"
LOCALE_PREFIX = "_ZNSt6locale"  # std::locale's members: defined only inside libstdc++ itself
STATIC_FLAGS = ("-static-libstdc++", "-static")
SYSTEM_CXX = "/usr/bin/g++"

_SHT_DYNAMIC = 6
_SHT_DYNSYM = 11
_DT_NEEDED = 1
_SHN_UNDEF = 0


@dataclass
class Verdict:
    """What check() found: ok, or the problems that refuse the file."""

    ok: bool
    needed: list[str] = field(default_factory=list)
    locale_symbols: list[str] = field(default_factory=list)  # defined std::locale members (first few)
    problems: list[str] = field(default_factory=list)


class ElfError(ValueError):
    """The file is not an ELF shared object this module can read."""


def _read(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ElfError(f"truncated ELF file (wanted {size} bytes at {offset})")
    return data


def _cstr(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    return table[offset:end if end >= 0 else len(table)].decode("utf-8", "replace")


def read_dynamic(path: str) -> tuple[list[str], list[str]]:
    """(NEEDED libraries, names of the defined dynamic symbols) of the ELF file at `path`."""
    with open(path, "rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != b"\x7fELF":
            raise ElfError(f"{path} is not an ELF file")
        wide = {1: False, 2: True}.get(ident[4])
        order = {1: "<", 2: ">"}.get(ident[5])
        if wide is None or order is None:
            raise ElfError(f"{path}: unknown ELF class {ident[4]} or data encoding {ident[5]}")
        if wide:
            shoff, = struct.unpack(order + "Q", _read(f, 0x28, 8))
            shentsize, shnum, shstrndx = struct.unpack(order + "HHH", _read(f, 0x3A, 6))
            sh_fmt, dyn_fmt, sym_fmt = order + "IIQQQQIIQQ", order + "qQ", order + "IBBHQQ"
        else:
            shoff, = struct.unpack(order + "I", _read(f, 0x20, 4))
            shentsize, shnum, shstrndx = struct.unpack(order + "HHH", _read(f, 0x2E, 6))
            sh_fmt, dyn_fmt, sym_fmt = order + "IIIIIIIIII", order + "iI", order + "IIIBBH"
        if shoff == 0 or shnum == 0:
            raise ElfError(f"{path} has no section headers")
        del shstrndx  # sections are found by type, not by name
        sections = []  # (type, offset, size, link, entsize)
        for i in range(shnum):
            fields = struct.unpack(sh_fmt, _read(f, shoff + i * shentsize, struct.calcsize(sh_fmt)))
            sh_type, sh_offset, sh_size, sh_link, sh_entsize = fields[1], fields[4], fields[5], fields[6], fields[9]
            sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))

        def strtab(index: int) -> bytes:
            _, off, size, _, _ = sections[index]
            return _read(f, off, size)

        needed: list[str] = []
        defined: list[str] = []
        for sh_type, off, size, link, entsize in sections:
            if sh_type == _SHT_DYNAMIC:
                names = strtab(link)
                step = entsize or struct.calcsize(dyn_fmt)
                data = _read(f, off, size)
                for pos in range(0, size - step + 1, step):
                    tag, val = struct.unpack_from(dyn_fmt, data, pos)
                    if tag == 0:
                        break
                    if tag == _DT_NEEDED:
                        needed.append(_cstr(names, val))
            elif sh_type == _SHT_DYNSYM:
                names = strtab(link)
                step = entsize or struct.calcsize(sym_fmt)
                data = _read(f, off, size)
                for pos in range(0, size - step + 1, step):
                    sym = struct.unpack_from(sym_fmt, data, pos)
                    shndx = sym[3] if wide else sym[5]
                    if shndx != _SHN_UNDEF and sym[0]:
                        defined.append(_cstr(names, sym[0]))
    return needed, defined


def check(path: str) -> Verdict:
    """Whether the extension at `path` uses the process's shared libstdc++ (Note [One libstdc++ per
    process]): NEEDED lists libstdc++.so.6 and no std::locale member is defined inside."""
    needed, defined = read_dynamic(path)
    locale = sorted(name for name in defined if name.startswith(LOCALE_PREFIX))
    problems = []
    if LIBSTDCXX not in needed:
        problems.append(f"it does not load the shared {LIBSTDCXX} (NEEDED: {', '.join(needed) or 'nothing'})")
    if locale:
        problems.append(f"it defines {len(locale)} std::locale internals itself (e.g. {locale[0]}): "
                        "it carries its own copy of libstdc++")
    return Verdict(ok=not problems, needed=needed, locale_symbols=locale[:5], problems=problems)


def _version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out else ""


def cause_and_fix(linker: list[str], ldflags: str, extra_link_args: list[str],
                  system_cxx: str | None = SYSTEM_CXX) -> tuple[str, str]:
    """What made the link static (a flag, else the compiler) and what to do about it.

    `linker`: the command that linked (compiler driver first); `ldflags`: $LDFLAGS;
    `system_cxx`: a compiler to recommend when the linker's own is at fault (if it exists)."""
    in_env = [flag for flag in shlex.split(ldflags) if flag in STATIC_FLAGS]
    in_cmd = [flag for flag in list(linker[1:]) + list(extra_link_args) if flag in STATIC_FLAGS]
    driver = linker[0] if linker else "c++"
    resolved = shutil.which(driver) or driver
    real = os.path.realpath(resolved)
    if in_env:
        return (f"the flag {in_env[0]} in LDFLAGS",
                f"build without it (unset LDFLAGS or remove {in_env[0]} from it) and rebuild")
    if in_cmd:
        return (f"the flag {in_cmd[0]} on the link command ({shlex.join(linker)})",
                f"remove {in_cmd[0]} from the link flags and rebuild")
    version = _version(resolved)
    cause = f"the C++ compiler {resolved}" + (f" ({version})" if version else "") + \
        ", which links libstdc++ statically by default (its specs or configuration do)"
    if system_cxx and os.path.exists(system_cxx) and os.path.realpath(system_cxx) != real:
        fix = (f"build with a compiler that links the shared libstdc++, e.g. the system's: "
               f"CXX={system_cxx} CC={os.path.join(os.path.dirname(system_cxx), 'gcc')} "
               "pip install --no-build-isolation . (or: python setup.py build_ext --inplace)")
    else:
        fix = "build with a C++ compiler that links the shared libstdc++ (set CXX and CC to it)"
    return cause, fix


def refusal(path: str, verdict: Verdict, cause: str, fix: str) -> str:
    """The message that stops the build."""
    return (f"[ringreduce setup] refusing the extension just linked, {path}: " + "; ".join(verdict.problems)
            + f". Cause: {cause}. Loaded into a process where torch already uses the shared {LIBSTDCXX}, two "
            "copies of the C++ runtime mix: its stream output loses numbers or crashes (SIGSEGV) as soon as "
            "an error message prints an integer. The file was deleted. Fix: " + fix + ".")


def enforce(path: str, linker: list[str], ldflags: str = "", extra_link_args: list[str] | None = None) -> Verdict:
    """setup.py's post-link step: returns the verdict when the extension is fine; otherwise deletes
    it and raises SystemExit with refusal()'s message."""
    verdict = check(path)
    if verdict.ok:
        return verdict
    cause, fix = cause_and_fix(linker, ldflags, extra_link_args or [])
    try:
        os.remove(path)
    except OSError:
        pass
    raise SystemExit(refusal(path, verdict, cause, fix))


if __name__ == "__main__":  # python tools/libstdcxx_check.py FILE...: print the verdicts
    import sys

    status = 0
    for p in sys.argv[1:]:
        v = check(p)
        print(f"{p}: {'ok' if v.ok else 'REFUSED: ' + '; '.join(v.problems)}")
        status |= 0 if v.ok else 1
    sys.exit(status)
