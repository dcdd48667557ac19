import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from ranks import close_pools  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()


# Modules with BOTH_TRANSPORTS = True run every test over both CPU transports: shared memory (the
# default for ranks of one host) and gloo point-to-point (RINGREDUCE_SHM=0). Their run_ranks calls
# use the pool of the test's transport. A test that parametrizes "_transport" itself (ranks.py's
# transport_cases and SHM_ONLY, Note [Transport cases]) runs only the combinations it lists; a GPU test
# (marked gpu: its ranks use NCCL, not a CPU transport) runs once.
def _parametrizes_transport(metafunc) -> bool:
    for mark in metafunc.definition.iter_markers(name="parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "_transport" in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    if (getattr(metafunc.module, "BOTH_TRANSPORTS", False) and "_transport" in metafunc.fixturenames
            and not _parametrizes_transport(metafunc) and metafunc.definition.get_closest_marker("gpu") is None):
        metafunc.parametrize("_transport", ["shm", "tcp"], indirect=True)


@pytest.fixture(autouse=True)
def _transport(request):
    import ranks

    saved = ranks.DEFAULT_TRANSPORT
    ranks.DEFAULT_TRANSPORT = getattr(request, "param", "shm")
    yield ranks.DEFAULT_TRANSPORT
    ranks.DEFAULT_TRANSPORT = saved


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
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("ringreduce")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def _nothing_left_in_dev_shm():
    """Every test, whatever it killed: no ringreduce segment is left in /dev/shm (Note [Shared-memory
    segments]: a segment is unlinked as soon as every rank of its ring has mapped it)."""
    before = _shm_entries()
    yield
    left = _shm_entries() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"


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
