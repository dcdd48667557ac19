import os
import re
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Importing torch._dynamo (this process, the ranks' forkserver, every DDP) makes inductor's cache
# folder, /tmp/torchinductor_<user> by default, and a compile fills it: the suite's goes into a folder
# of its own, removed at the end (unless TORCHINDUCTOR_CACHE_DIR names one already). Set before any
# import of torch, so that every process the suite starts inherits it.
_OWN_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
if _OWN_INDUCTOR_CACHE:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ringreduce-tests-inductor-")

import gpu.gpu_ranks  # noqa: E402,F401 - registers the place "cuda" (Note [Places])
from ranks import close_pools  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "full: only in the full suite (bash scripts/test.sh --all, CI), not in the "
                            "default set (tests/README.md, \"The default run\")")
    config.addinivalue_line("markers", "full_at(*places): the test's cases at those places are marked full")


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    """ranks.full_at("tcp", ws=3): the test's cases at those places (with those parameters) run only in
    the full suite."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        for mark in item.iter_markers(name="full_at"):
            if callspec.params.get("place") in mark.args and all(
                    callspec.params.get(k) == v for k, v in mark.kwargs.items()):
                item.add_marker(pytest.mark.full)
                break


@pytest.fixture(scope="session", autouse=True)
def _rank_pools(request):
    """Closes every pool at the end of the session; where a GPU is visible, says once how the GPU
    ranks run (Note [Ranks sharing a GPU])."""
    from gpu.gpu_ranks import shared, transport, visible_gpus, world

    if visible_gpus():
        how = ("NCCL's socket transport over lo (each rank its own NCCL_HOSTID), not NVLink or P2P"
               if shared() else "one GPU per rank")
        line = (f"ringreduce GPU tests: {world()} ranks on {visible_gpus()} GPU(s), {transport()}: {how} "
                "(RINGREDUCE_GPU_WORLD sets the world size)")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)
    yield
    close_pools()


def pytest_unconfigure(config):
    if _OWN_INDUCTOR_CACHE:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


# Note [Places] (ranks.py): a module with PLACES = ranks.ALL_PLACES (or CPU_PLACES) runs every test at
# every place it names: "shm" and "tcp" (CPU tensors over shared memory, or gloo point-to-point with
# RINGREDUCE_SHM=0) and "cuda" (CUDA tensors over ringreduce's NCCL ring; marked gpu, skipped without a
# GPU). run_ranks uses the pool of the test's place. A test that parametrizes "place" itself
# (ranks.place_cases, only_place, SHM_ONLY) runs only the combinations it lists; a GPU test (marked
# gpu: its ranks use NCCL itself) runs once.
def _parametrizes_place(metafunc) -> bool:
    for mark in metafunc.definition.iter_markers(name="parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "place" in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    from ranks import place_param

    places = getattr(metafunc.module, "PLACES", ())
    if (places and "place" in metafunc.fixturenames and not _parametrizes_place(metafunc)
            and metafunc.definition.get_closest_marker("gpu") is None):
        metafunc.parametrize("place", [place_param(p) for p in places], indirect=True)


@pytest.fixture(autouse=True)
def place(request):
    """The test's place (Note [Places]): "shm" unless its module or its parametrization says otherwise."""
    import ranks

    saved = ranks.DEFAULT_PLACE
    ranks.DEFAULT_PLACE = getattr(request, "param", "shm")
    yield ranks.DEFAULT_PLACE
    ranks.DEFAULT_PLACE = saved


def _creator(name: str) -> int | None:
    m = re.match(r"ringreduce-(\d+)-", name)
    return int(m.group(1)) if m else None


def _descends_from_us(pid: int) -> bool | None:
    """Whether process `pid` is this one or below it; None when it no longer exists."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
        except (OSError, ValueError, IndexError):
            return None
    return False


@pytest.fixture(autouse=True)
def _knobs_as_the_environment_says():
    """After every test, once monkeypatch has put the environment back (this fixture is set up before
    it, so torn down after it): the knobs are read again, so that a test's RINGREDUCE_* never reaches
    the next test through rings made later (Note [Knobs are read when a ring is made])."""
    yield
    reload = getattr(sys.modules.get("ringreduce"), "reload_knobs", None)
    if reload is not None:
        reload()


def _shm_entries() -> set[str]:
    """ringreduce's segments in /dev/shm, less those of live processes that are not this session's (other
    test runs on a shared machine): a segment a dead process left counts, whoever made it."""
    from ringreduce._launch import shm_entries

    return {n for n in shm_entries() if _creator(n) is None or _descends_from_us(_creator(n)) is not False}


# GPU-only tests on a machine without a CUDA GPU: one line in the -ra summary for all of them
# ("SKIPPED [65] tests/conftest.py: GPU-only tests ...") instead of one per test module and line.
# Which tests run is unchanged (`pytest -m gpu` still selects them; they skip here as before). Where
# a GPU exists each skip keeps its own reason (a world too small, a GPU per rank needed...).
_NEEDS_GPUS = re.compile(r"\bCUDA GPUs?\b")


def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_skip_summary(gpu_marked: bool, reason: str, found: int) -> str | None:
    """The shared -ra line for a skipped test (`gpu_marked`: it has the gpu marker; `reason`: its own
    skip reason; `found`: this machine's CUDA GPUs), or None to keep its own reason."""
    if found > 0 or not (gpu_marked or _NEEDS_GPUS.search(reason)):
        return None
    return (f"GPU-only tests (tests/gpu and the multi-GPU cases): this machine has {found} CUDA GPUs; "
            "they run where a CUDA GPU exists (pytest -m gpu; some need a GPU per rank)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not isinstance(report.longrepr, tuple) or len(report.longrepr) != 3:
        return
    summary = gpu_skip_summary(item.get_closest_marker("gpu") is not None, str(report.longrepr[2]), _cuda_gpus())
    if summary is not None:
        report.longrepr = (__file__, None, summary)
