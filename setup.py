"""Build of ringreduce._C: the CPU ring always, CUDA+NCCL when a toolkit and a CUDA torch exist.

Environment knobs:
  CUDA_HOME / CUDA_PATH   CUDA toolkit (else /usr/local/cuda, else the folder above the real nvcc)
  NCCL_HOME               NCCL headers/library (else the nvidia-nccl wheel that CUDA torch installs)
  TORCH_CUDA_ARCH_LIST    GPU architectures. Default: those of the GPUs visible here (PTX of the newest
                          too); with no GPU visible one, "9.0+PTX" (H100 and, JIT-compiled from PTX,
                          later GPUs). A build for other GPUs (a login node building for GPU nodes, a
                          wheel) names them, e.g. "8.0;9.0;10.0;12.0+PTX" (portable_cuda_archs)
  RINGREDUCE_FORCE_CPU=1  skip CUDA even when it is available
  RINGREDUCE_REQUIRE_CUDA=1  fail instead of falling back to a CPU-only build (CI uses this)
  RINGREDUCE_CPU_WITHOUT_GPU=1  (scripts/bench.sh) CPU-only when no GPU is visible and
                          TORCH_CUDA_ARCH_LIST is unset, unless a CUDA build is here already
  MAX_JOBS                parallel compile jobs (ninja)
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _log(msg: str) -> None:
    print(f"[ringreduce setup] {msg}", file=sys.stderr)


def _real_nvcc_home() -> str | None:
    """The toolkit folder above the real nvcc binary (PATH may hold a wrapper script)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    path = os.path.realpath(nvcc)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"\x7fELF":  # a wrapper script: find the binary it execs
            with open(path, encoding="utf-8", errors="replace") as f:
                for token in f.read().split():
                    token = token.strip("\"'")
                    if token.endswith("/nvcc") and os.path.isfile(token):
                        path = os.path.realpath(token)
                        break
                else:
                    return None
    except OSError:
        return None
    home = os.path.dirname(os.path.dirname(path))
    return home if os.path.isfile(os.path.join(home, "bin", "nvcc")) else None


def find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return _real_nvcc_home()


def find_nccl() -> tuple[str, str] | None:
    """(include dir, lib dir) holding nccl.h and libnccl.so*."""
    candidates = []
    if os.environ.get("NCCL_HOME"):
        candidates.append(os.environ["NCCL_HOME"])
    for site in sys.path:
        candidates.append(os.path.join(site, "nvidia", "nccl"))
    for base in candidates:
        inc, lib = os.path.join(base, "include"), os.path.join(base, "lib")
        if os.path.isfile(os.path.join(inc, "nccl.h")) and glob.glob(os.path.join(lib, "libnccl.so*")):
            return inc, lib
    return None


NO_GPU_ARCHS = "9.0+PTX"


def default_cuda_archs(nvcc_arch_list: str, visible: list[tuple[int, int]]) -> str:
    """TORCH_CUDA_ARCH_LIST's default, sized to this machine: the compute capabilities of the `visible`
    GPUs that the toolkit knows (`nvcc --list-gpu-arch` output; an empty list knows every one), with
    PTX of the newest, so that newer GPUs JIT-compile the kernels instead of failing with "no kernel
    image"; with no GPU visible (or none the toolkit knows) one architecture, NO_GPU_ARCHS: each
    architecture is another compile of every kernel (about a minute on 2 cores). A build for other
    GPUs than these sets TORCH_CUDA_ARCH_LIST (portable_cuda_archs lists the portable set)."""
    known = set(nvcc_arch_list.split())
    archs = sorted({f"{major}.{minor}" for major, minor in visible
                    if not known or f"compute_{major}{minor}" in known}, key=lambda a: tuple(map(int, a.split("."))))
    if not archs:
        return NO_GPU_ARCHS
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def portable_cuda_archs(nvcc_arch_list: str) -> str:
    """The architectures of a build meant for any recent GPU (a wheel, a login node building for GPU
    nodes of unknown kind): sm_80 and sm_90 code, sm_100 and sm_120 code where the toolkit knows
    them, and PTX of the newest of those. Four compiles of every kernel: opt in with
    TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0;12.0+PTX"."""
    known = set(nvcc_arch_list.split())
    archs = ["8.0", "9.0"] + [a for a in ("10.0", "12.0") if f"compute_{a.replace('.', '')}" in known]
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def _visible_gpus() -> list[tuple[int, int]]:
    """Compute capabilities of the GPUs torch sees here (none on a CPU-only torch or without a driver).
    Importing torch itself is safe before CUDA_HOME is settled; torch.utils.cpp_extension is not."""
    import torch

    try:
        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU" for the build's purposes
        return []


def _nvcc_arch_list(cuda_home: str | None) -> str:
    try:
        return subprocess.run([os.path.join(cuda_home or "", "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                              text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def quickstart_cpu_only(env: Mapping[str, str], visible: list[tuple[int, int]], cuda_built_here: bool) -> bool:
    """Whether the Quickstart's benchmark build skips CUDA (Note [First-build time]): scripts/bench.sh
    asks for it (RINGREDUCE_CPU_WITHOUT_GPU=1) and the benchmark it runs here is CPU-only: no GPU
    visible, no TORCH_CUDA_ARCH_LIST (a build for GPUs elsewhere), no RINGREDUCE_REQUIRE_CUDA, and
    no CUDA build in the object folder already (that one rebuilds incrementally, in seconds).
    pip install, scripts/test.sh and CI never set it: they build the CUDA part wherever they can."""
    return (env.get("RINGREDUCE_CPU_WITHOUT_GPU") == "1" and not visible and not env.get("TORCH_CUDA_ARCH_LIST")
            and env.get("RINGREDUCE_REQUIRE_CUDA") != "1" and not cuda_built_here)


def _cuda_built_here() -> bool:
    """Whether the object folder (BuildExt's build-ext) holds a CUDA build."""
    try:
        with open(os.path.join(ROOT, "build-ext", "build.ninja"), encoding="utf-8") as f:
            return "RR_WITH_CUDA" in f.read()
    except OSError:
        return False


# CUDA_HOME must be right before torch.utils.cpp_extension is imported: it guesses at import time.
CUDA_HOME = None if os.environ.get("RINGREDUCE_FORCE_CPU") == "1" else find_cuda_home()
ARCHS_DEFAULTED = bool(CUDA_HOME) and not os.environ.get("TORCH_CUDA_ARCH_LIST")
VISIBLE_GPUS = _visible_gpus() if ARCHS_DEFAULTED else []
QUICKSTART_CPU = bool(CUDA_HOME) and quickstart_cpu_only(os.environ, VISIBLE_GPUS, _cuda_built_here())
if QUICKSTART_CPU:
    CUDA_HOME, ARCHS_DEFAULTED = None, False
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME
if ARCHS_DEFAULTED:
    os.environ["TORCH_CUDA_ARCH_LIST"] = default_cuda_archs(_nvcc_arch_list(CUDA_HOME), VISIBLE_GPUS)
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", NO_GPU_ARCHS)

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _source_list():
    """tools/source_list.py, loaded by path: the groups of csrc/sources.cmake, the one source list."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("source_list", os.path.join(ROOT, "tools", "source_list.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sources(*groups: str) -> list[str]:
    """The files of csrc/sources.cmake's `groups`."""
    return _source_list().sources(ROOT, *groups)


# Note [First-build time]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A first build compiles every translation unit; on 2 cores most of its time goes to the few that
# include torch's headers (csrc/torch/*.cpp, csrc/cpu/c10d_transport.cpp: ~400k lines each) and to
# the kernel .cu files. Hence:
#   * host code without debug information (-g0 after Python's own "-g"): it halves the torch TUs'
#     compile time and their objects shrink from ~27 MB to ~1 MB; nvcc keeps -lineinfo (profilers).
#   * csrc/cpu/c10d_transport.cpp compiled inside csrc/torch/cpu_ops.cpp (group cpu_torch): one
#     parse of c10d's headers instead of two.
#   * the longest TUs first (HEAVY_FIRST, BuildExt): ninja starts steps in the order the build file
#     lists them, and setuptools sorts by name, which started the torch TUs last while a core idled.
# Per-object times of the last build: ninja's log, build-ext/.ninja_log (start, end in ms, object).
HEAVY_FIRST = ("csrc/torch/bindings.cpp", "csrc/torch/cuda_bindings.cpp", "csrc/cuda/reduce_kernels_half.cu",
               "csrc/torch/cpu_ops.cpp", "csrc/cuda/reduce_kernels.cu", "csrc/cuda/one_shot_kernels.cu",
               "csrc/cpu/host_reduce.cpp")
# csrc/sources.cmake's group cpu_torch (csrc/cpu/c10d_transport.cpp) is compiled inside
# csrc/torch/cpu_ops.cpp, which #includes it: the two are the TUs that parse c10d's headers.


def heavy_first(srcs: list[str]) -> list[str]:
    """`srcs` with the HEAVY_FIRST ones first, in that order (Note [First-build time])."""
    rank = {s: i for i, s in enumerate(HEAVY_FIRST)}
    return sorted(srcs, key=lambda s: rank.get(os.path.relpath(os.path.join(ROOT, s), ROOT), len(rank)))


def build_extension():
    cxx_flags = ["-O3", "-g0", "-std=c++20", "-Wall", "-Wno-unused-function"]
    define_macros = [("RR_VERSION", f'"{VERSION}"'), ("RR_TORCH_VERSION", f'"{torch.__version__}"')]
    srcs = sources("core", "cpu", "torch")  # cpu_torch: inside cpu_ops.cpp
    cuda_srcs = sources("cuda_logic", "cuda_runtime", "cuda_device")
    torch_cuda_glue = sources("torch_cuda")

    nccl = find_nccl()
    reasons = []
    if QUICKSTART_CPU:
        reasons.append("no GPU visible and TORCH_CUDA_ARCH_LIST unset, so scripts/bench.sh builds the CPU part "
                       "only, the part its benchmark runs here (scripts/test.sh, pip install -e . or "
                       "TORCH_CUDA_ARCH_LIST=9.0 bash scripts/bench.sh build CUDA too)")
    elif not CUDA_HOME:
        reasons.append("no CUDA toolkit found (set CUDA_HOME)")
    if torch.version.cuda is None:
        reasons.append("torch is a CPU-only build")
    if nccl is None:
        reasons.append("no NCCL found (install the nvidia-nccl wheel or set NCCL_HOME)")
    if not cuda_srcs:
        reasons.append("no CUDA sources")
    if reasons:
        msg = "building ringreduce WITHOUT CUDA: " + "; ".join(reasons)
        if os.environ.get("RINGREDUCE_REQUIRE_CUDA") == "1":
            raise SystemExit(f"[ringreduce setup] RINGREDUCE_REQUIRE_CUDA=1 but {msg}")
        _log(msg)
        return CppExtension(
            "ringreduce._C",
            srcs,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
        )

    inc, lib = nccl
    archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    _log(f"building ringreduce with CUDA ({CUDA_HOME}, archs {archs}) and NCCL ({lib})")
    if ARCHS_DEFAULTED and not VISIBLE_GPUS:
        _log(f"no GPU visible here: the CUDA kernels are compiled for {archs} only (H100, and newer GPUs from "
             "PTX); to build for other GPUs (e.g. on a login node for GPU nodes) set TORCH_CUDA_ARCH_LIST, "
             "e.g. '8.0;9.0;10.0;12.0+PTX'; RINGREDUCE_FORCE_CPU=1 builds no CUDA at all")
    elif ARCHS_DEFAULTED:
        _log(f"TORCH_CUDA_ARCH_LIST unset: the kernels are compiled for the visible GPUs ({archs}); set it to "
             "build for other GPUs")
    arch_list = ",".join(a.strip() for a in archs.replace(",", ";").split(";") if a.strip())
    define_macros += [("RR_WITH_CUDA", "1"), ("RR_CUDA_ARCHS", f'"{arch_list}"')]
    return CUDAExtension(
        "ringreduce._C",
        srcs + torch_cuda_glue + cuda_srcs,
        include_dirs=[os.path.join(ROOT, "csrc"), inc],
        library_dirs=[lib],
        libraries=[":libnccl.so.2"] if not glob.glob(os.path.join(lib, "libnccl.so")) else ["nccl"],
        define_macros=define_macros,
        extra_compile_args={
            "cxx": cxx_flags,
            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"],
        },
        extra_link_args=[f"-Wl,-rpath,{lib}"],
    )


def _libstdcxx_check():
    """tools/libstdcxx_check.py, loaded by path (importing the ringreduce package needs the extension)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("libstdcxx_check", os.path.join(ROOT, "tools", "libstdcxx_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildExt(BuildExtension):
    """torch's BuildExtension with a persistent object folder, so ninja rebuilds only what changed
    (pip's editable installs otherwise compile everything in a fresh temporary folder), and a check
    of what it linked: an extension that carries its own copy of libstdc++ is deleted and the build
    stops (Note [One libstdc++ per process], tools/libstdcxx_check.py)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build-ext")

    def build_extension(self, ext) -> None:
        # setuptools sorts the sources by name before it compiles them; torch's ninja compile (set up
        # by BuildExtension.build_extensions) gets them back heavy first (Note [First-build time]).
        ninja_compile = self.compiler.compile
        self.compiler.compile = lambda sources, *args, **kwargs: ninja_compile(heavy_first(sources), *args, **kwargs)
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = ninja_compile
        # The command that linked: setuptools puts the C++ driver (compiler_cxx, i.e. $CXX) in front
        # of the shared-library link flags (linker_so_cxx, else linker_so, which carry $LDFLAGS).
        flags = list(getattr(self.compiler, "linker_so_cxx", None) or self.compiler.linker_so)[1:]
        linker = list(self.compiler.compiler_cxx or self.compiler.linker_so)[:1] + flags
        check = _libstdcxx_check()
        check.enforce(self.get_ext_fullpath(ext.name), linker, os.environ.get("LDFLAGS", ""), list(ext.extra_link_args))
        _log(f"{ext.name} uses the shared {check.LIBSTDCXX} (checked after linking)")


setup(
    name="ringreduce",
    version=VERSION,
    description="Gradient averaging with a pipelined ring all-reduce over NCCL and gloo point-to-point",
    packages=find_packages(include=["ringreduce", "ringreduce.*"]),
    # The packages live at the project root: an editable install then adds the root to sys.path (a
    # .pth file) instead of a meta path finder that a folder named ringreduce in the working directory
    # (the clone itself, seen from its parent) would shadow, which setuptools warns about.
    package_dir={"": "."},
    package_data={"ringreduce": ["py.typed"]},
    ext_modules=[build_extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
)
