"""The tests' multi-process harness: ranks on loopback for the CPU suites and, through the GPU layer
tests/gpu/gpu_ranks.py (which GPU each rank uses, NCCL's environment, the skips), for the GPU tests.

``run_ranks(n, fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank of a persistent pool
of n processes (one pool per place and world size, reused across tests and modules so the suite stays
fast) and returns the per-rank results. The place (Note [Places]: ``"shm"``, ``"tcp"`` or ``"cuda"``;
default the test's, which conftest.py sets from the `place` fixture) is fixed when a pool starts: a
ring decides on shared memory at its first call (RINGREDUCE_SHM); inside a job ``device(rank)`` is
where its tensors go. ``spawn_ranks`` runs one job on fresh processes (for tests that kill ranks or
poison their groups) and reports every rank's status and exit code. ``fn`` must be a module-level
function of an importable module (a test file). The processes themselves are started, logged and
killed by ringreduce/_launch.py, the launcher the benchmark and the GPU checks use too.

Every group of ranks (RankGroup; a RankKind says how its processes start):

* **Failures are reported at once**: the parent polls every rank's pipe and exit code; a rank that
  dies (a signal, an unexpected exit) fails the test within a second or two with its exit code, the
  signal's name and the tail of what it printed (each rank's stdout and stderr go to a log file;
  faulthandler prints the Python stack of a crash there), after the other ranks got GRACE_S to
  report. A rank that raises fails the test with its traceback; a job that exceeds ``timeout`` is
  killed after every rank printed the Python stacks of its threads (faulthandler on SIGUSR1), so a
  hang says where it hung. Either way the pool is discarded: the next test starts on fresh ranks.
* **Startup** (process start and process group creation, at most STARTUP_S) is not charged to the
  first job's timeout.
* **A deadline for the whole run**: ``RINGREDUCE_GPU_DEADLINE`` (Unix time; scripts/gpu_check.sh
  sets it a little before its step's limit) shortens every job's timeout and the ranks' startup to
  what is left before it, so a hang is reported, stacks and all, before the step's own limit kills
  pytest and with it every rank; once it has passed, the remaining tests skip.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ringreduce._launch import RankProcesses, describe_exit, free_port

__all__ = ["describe_exit", "free_port"]  # the shared launcher's (ringreduce/_launch.py), used by tests here

_CTX = mp.get_context("spawn")  # the pipes to the ranks (RankProcesses starts them in this context)
DEFAULT_TIMEOUT = 180.0
ALL_PLACES = ("shm", "tcp", "cuda")  # where a behavioural test runs: Note [Places]
CPU_PLACES = ("shm", "tcp")
TRANSPORTS = {"shm": "1", "tcp": "0"}  # RINGREDUCE_SHM of a CPU pool's processes
DEFAULT_PLACE = "shm"  # the library's default for ranks of one host; conftest.py sets it per test
PLACE_VAR = "RINGREDUCE_TEST_PLACE"  # a rank's place, for device() inside its jobs
GRACE_S = 5.0  # after a rank died: how long the others may still report before they are killed
STARTUP_S = 180.0  # process start and process group creation, before the first job
LOG_TAIL = 4000  # characters of a failed rank's output in the report
DEADLINE_VAR = "RINGREDUCE_GPU_DEADLINE"  # Unix time by which every job must have ended (gpu_check.sh's step limit)


# Note [Places]
# ~~~~~~~~~~~~~
# A place is a (device, transport) pair a ring runs on: "shm" (CPU tensors, ranks of one host in shared
# memory, the library's default), "tcp" (CPU tensors over gloo point-to-point, RINGREDUCE_SHM=0) and
# "cuda" (CUDA tensors over ringreduce's NCCL ring; tests/gpu/gpu_ranks.py registers it, and its cases
# are marked gpu and skip where no CUDA GPU is visible, in one line of the summary). A test module names
# its places once, `PLACES = ranks.ALL_PLACES` (or CPU_PLACES, for bodies that use CPU tensors only), and
# conftest.py runs every test of it at every one of them through the `place` fixture; run_ranks then
# uses the pool of the test's place, and a job's tensors go to `device(rank)`. The pools live for the
# session, one per (place, world size): one process group and, on a GPU, one NCCL communicator serve
# every test of every module (issue 48). A test whose cases are a matrix lists its places itself:
#
# * `place_cases("ws", [2, 3, 5], tcp=[3], cuda=[2])`: every case over shm, the listed subsets over tcp
#   and cuda (the other combinations are not generated at all: no skips);
# * `SHM_ONLY` / `only_place("tcp")`: one place, for a test whose other runs would only repeat Python or
#   core code (no ranks, or a refusal before any call), or whose ranks pick a transport themselves.
#
# Why a subset suffices over tcp: the arithmetic of every dtype x op x world size is csrc/core's, the same
# for both CPU transports; below the transport seam (csrc/core/transport.h) gloo point-to-point moves
# bytes (csrc/cpu/c10d_transport.cpp, ring_executor.cpp) whatever the dtype. The tcp cases keep what that
# side distinguishes: 2 ranks (both neighbours one peer) and more, uneven chunks, one-shot, single- and
# many-segment calls, the 16-bit converts and wires, agreement frames and refusals, failures and
# interrupts; refdata.types_for(place) is the dtype subset that sweeps inside a test use (TCP_TYPES).


def place_param(place: str) -> Any:
    """`place` as a parameter of the `place` fixture: marked gpu, and skipped without a CUDA GPU, for
    "cuda"."""
    if place != "cuda":
        return pytest.param(place, id=place)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.param(place, id=place, marks=[pytest.mark.gpu, pytest.mark.skipif(
        gpus == 0, reason=f"needs a CUDA GPU (found {gpus})")])


FULL = pytest.mark.full  # only in the full suite: tests/README.md, "The default run"


def place_cases(argnames: str, cases: list, tcp: list | None = None, cuda: list | None = None,
                ids: Callable | None = None, full: list | None = None) -> Any:
    """A parametrize mark over ("place", *argnames): every one of `cases` over "shm", the `tcp` subset
    over "tcp" (`None`: all of them; `[]`: none) and the `cuda` subset over "cuda" (`None`: none). A case
    is a value for one argname, else a tuple. `full`: the (place, case) pairs that run only in the full
    suite (marked full). Ids: "tcp-3", or "tcp-" + ids(case)."""
    tcp = list(cases) if tcp is None else list(tcp)
    cuda = list(cuda or [])
    missing = [c for c in tcp + cuda if c not in cases]
    assert not missing, f"tcp/cuda cases {missing} are not among the shm cases"
    full = list(full or [])
    single = "," not in argnames
    rows = []
    for place, subset in (("shm", cases), ("tcp", tcp), ("cuda", cuda)):
        marks = list(place_param(place).marks)
        for c in subset:
            values = (place, c) if single else (place, *c)
            extra = [FULL] if (place, c) in full else []
            rows.append(pytest.param(*values, marks=marks + extra, id=f"{place}-{ids(c)}" if ids else None))
    unknown = [f for f in full if f[0] not in ("shm", "tcp", "cuda") or f[1] not in
               {"shm": cases, "tcp": tcp, "cuda": cuda}[f[0]]]
    assert not unknown, f"full cases {unknown} are not among the cases"
    return pytest.mark.parametrize(f"place,{argnames}", rows, indirect=["place"])


def full_at(*places: str, **params: Any) -> Any:
    """A mark: the test's cases at `places` (and, given `params`, with those parameter values) run only
    in the full suite (conftest.py marks them full). Several may be stacked."""
    return pytest.mark.full_at(*places, **params)


def only_place(*places: str) -> Any:
    """A parametrize mark running a test at `places` only: "shm" for a test whose tcp run would retest
    only the core or Python code, "tcp" for one that picks tcp itself."""
    return pytest.mark.parametrize("place", [place_param(p) for p in places], indirect=True)


SHM_ONLY = only_place("shm")


def device(rank: int) -> Any:
    """The device of rank `rank`'s tensors in this job: its GPU at the place "cuda" (round-robin over
    the visible GPUs, Note [Ranks sharing a GPU]), else the CPU."""
    import torch

    if os.environ.get(PLACE_VAR) == "cuda":
        from ringreduce.bench.gpu_map import rank_device

        return torch.device("cuda", rank_device(rank, torch.cuda.device_count()))
    return torch.device("cpu")


def on_cuda() -> bool:
    """Whether this job runs at the place "cuda" (inside a rank)."""
    return os.environ.get(PLACE_VAR) == "cuda"


def _reload_knobs() -> None:
    """ringreduce.reload_knobs() where ringreduce is imported (Note [Knobs are read when a ring is made]
    in ringreduce/_config.py); a bad value is left for the job's calls to raise."""
    reload = getattr(sys.modules.get("ringreduce"), "reload_knobs", None)
    if reload is not None:
        with contextlib.suppress(ValueError):
            reload()


@contextlib.contextmanager
def job_environ(env: dict) -> Iterator[None]:
    """os.environ with `env` set (values as strings) for one job of a rank, as it was afterwards; the
    rings read their knobs again on both sides."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    if env:
        _reload_knobs()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if env:
            _reload_knobs()


def time_left() -> float | None:
    """Seconds left before $RINGREDUCE_GPU_DEADLINE (None when it is unset)."""
    raw = os.environ.get(DEADLINE_VAR, "")
    if not raw:
        return None
    try:
        deadline = float(raw)
    except ValueError:
        raise ValueError(f"{DEADLINE_VAR}={raw!r} is not a Unix time in seconds") from None
    return deadline - time.time()


def within_deadline(seconds: float) -> tuple[float, str]:
    """`seconds`, shortened to the time left before the run's deadline, and what limited it ("" when
    not the deadline); skips the test when the deadline has passed."""
    left = time_left()
    if left is None or left >= seconds:
        return seconds, ""
    if left < 1.0:
        pytest.skip(f"not run: the deadline of this run ({DEADLINE_VAR}, scripts/gpu_check.sh's step limit) has passed")
    return left, f", all that was left before {DEADLINE_VAR}"


class RankKind:
    """How a rank's process starts: this class, the CPU suites' gloo ranks (one torch thread each);
    tests/gpu/gpu_ranks.py's GpuRank, the GPU tests'. Pickled to every rank."""

    name = "rank"  # the processes' names: "rank 0", ...
    folder = "rr_ranks_"  # prefix of the group's temporary folder (init file, rank logs)
    pg_timeout = 60.0  # the process group's timeout (s)

    def __init__(self, pg_timeout: float | None = None) -> None:
        if pg_timeout is not None:
            self.pg_timeout = pg_timeout

    def start(self, rank: int, world_size: int) -> str:
        """Prepares the rank's process before its process group is created; returns the backend."""
        import torch

        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        return "gloo"

    def after_job(self, rank: int) -> None:
        """Runs after every job of the rank, as part of the job (an exception fails it)."""


def _rank_main(rank: int, world_size: int, kind: RankKind, init_file: str, conn: Any, one_job: bool) -> None:
    # Started by RankProcesses (ringreduce/_launch.py): its output goes to its log (the parent reports its
    # tail when the rank fails), with faulthandler's stacks of a crash or of SIGUSR1 (a hung job).
    try:
        import torch.distributed as dist

        backend = kind.start(rank, world_size)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=kind.pg_timeout))
        if not one_job:
            # A pool's rank imports what DDP imports at its first use (torch._dynamo: seconds, a minute and
            # more on a loaded machine) during startup, which no job's timeout is charged with.
            import torch._dynamo  # noqa: F401
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("err", f"process group setup failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        fn, args, kwargs, env = job
        try:
            with job_environ(env):
                result = fn(rank, world_size, *args, **kwargs)
                kind.after_job(rank)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if one_job:  # spawn_ranks: the process exits with its group as the job left it
            return
    dist.destroy_process_group()


class RankGroup:
    """`world_size` rank processes with a process group, running jobs until closed (`one_job`: the
    processes exit after their first job, without destroy_process_group)."""

    def __init__(self, world_size: int, kind: RankKind, base_env: dict | None = None, one_job: bool = False,
                 daemon: bool = False) -> None:
        self.world_size = world_size
        self.offsets = [0] * world_size  # where the current job's output starts in each log
        self.conns: list[Any] = []
        children: list[Any] = []
        for _ in range(world_size):
            parent, child = _CTX.Pipe()
            self.conns.append(parent)
            children.append(child)
        self.broken = False
        self.exit_asked = False
        self.ready = False
        self.ranks = RankProcesses(world_size, name=kind.name, prefix=kind.folder)
        self.tmp = self.ranks.folder
        self.ranks.start(_rank_main, lambda r: (r, world_size, kind, self.ranks.init_file, children[r], one_job),
                         env=base_env, daemon=daemon)
        for child in children:
            child.close()

    @property
    def procs(self) -> list[Any]:
        return self.ranks.procs

    def output(self, rank: int, since_job: bool = True) -> str:
        return self.ranks.output(rank, self.offsets[rank] if since_job else 0, LOG_TAIL)

    def wait_ready(self, fn: Callable, limit: float = STARTUP_S) -> None:
        """Every rank has its process group (startup is not charged to the first job's timeout)."""
        startup_s, _ = within_deadline(limit)
        deadline = time.monotonic() + startup_s
        problems = []
        for r, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True)):
            while not conn.poll(0.05):
                if not proc.is_alive() or time.monotonic() > deadline:
                    break
            try:
                status, payload = conn.recv() if conn.poll(0) else ("died", None)
            except (EOFError, OSError):
                status, payload = "died", None
            if status == "err":
                problems.append(f"--- rank {r}: {payload}")
            elif status == "died":
                proc.join(timeout=2)
                what = describe_exit(proc.exitcode) if not proc.is_alive() else f"not ready within {startup_s:.0f} s"
                problems.append(f"--- rank {r} did not start: {what}; its output:\n"
                                f"{self.output(r, False) or '(nothing)'}")
        if problems:
            self.kill()
            pytest.fail(f"{fn.__name__}: the ranks did not start\n" + "\n".join(problems), pytrace=False)
        self.ready = True

    def collect(self, fn: Callable, args: tuple, kwargs: dict, env: dict, timeout: float, exits: dict[int, int],
                grace: float | None) -> tuple[list[Any], dict[int, str], dict[int, int | None], set[int]]:
        """Sends the job to every rank and polls them until each answered or died, the timeout passed or
        (`grace` not None) `grace` s after the first rank died or raised. Returns the results, the
        tracebacks of ranks that raised, the exit codes of ranks that died (other than as `exits`
        allows: those give None) and the ranks still running."""
        for r in range(self.world_size):
            self.offsets[r] = self.ranks.log_size(r)
            self.conns[r].send((fn, args, kwargs, env))
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        dead: dict[int, int | None] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        first_failure: float | None = None  # a rank died or raised: the others get `grace` to report
        while pending:
            now = time.monotonic()
            if now > deadline or (grace is not None and first_failure is not None and now - first_failure > grace):
                break
            for r in sorted(pending):
                conn, proc = self.conns[r], self.procs[r]
                if conn.poll(0.02):
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):  # died while (or instead of) answering
                        proc.join(timeout=5)
                        pending.discard(r)
                        if not (r in exits and proc.exitcode == exits[r]):  # else: died as the test meant it to
                            dead[r] = proc.exitcode
                            first_failure = first_failure or time.monotonic()
                        continue
                    pending.discard(r)
                    if status == "ok":
                        results[r] = payload
                    else:
                        errors[r] = payload
                        first_failure = first_failure or time.monotonic()
                elif not proc.is_alive():
                    proc.join(timeout=1)
                    if conn.poll(0):  # its answer arrived just before it exited
                        continue
                    pending.discard(r)
                    if r in exits and proc.exitcode == exits[r]:
                        continue  # died as the test meant it to
                    dead[r] = proc.exitcode
                    first_failure = first_failure or time.monotonic()
        return results, errors, dead, pending

    def run(self, fn: Callable, args: tuple, kwargs: dict, env: dict, timeout: float,
            exits: dict[int, int]) -> list[Any]:
        """Runs fn on every rank; returns the results, or fails the test with every failed rank's report
        (and stops the group)."""
        if not self.ready:
            self.wait_ready(fn)
        timeout, cut = within_deadline(timeout)
        results, errors, dead, pending = self.collect(fn, args, kwargs, env, timeout, exits, GRACE_S)
        if pending and not (dead or errors):  # a hang: where is every rank stuck? (Python stacks)
            self.ranks.dump_stacks(pending)
            time.sleep(1.0)
        if pending or dead or errors:
            self._stop()  # the logs stay until the report below has read them
        report = []
        for r, code in sorted(dead.items()):
            report.append(f"--- rank {r} died: {describe_exit(code)} while running {fn.__name__}; its output:\n"
                          f"{self.output(r) or '(nothing)'}")
        for r in sorted(pending):
            why = "did not finish within the timeout" if not (dead or errors) else "still running after a rank failed"
            report.append(f"--- rank {r} {why} ({timeout:.0f} s for {fn.__name__}{cut}; killed); its output:\n"
                          f"{self.output(r) or '(nothing)'}")
        for r, tb in sorted(errors.items()):
            out = self.output(r)
            report.append(f"--- rank {r} raised:\n{tb}" + (f"\n    its output:\n{out}" if out.strip() else ""))
        if report:
            parts = [f"rank {r} {describe_exit(c)}" for r, c in sorted(dead.items())]
            parts += [f"ranks {sorted(errors)} raised"] if errors else []
            parts += [f"ranks {sorted(pending)} did not finish"] if pending else []
            head = f"{fn.__name__} failed on {self.world_size} ranks: " + "; ".join(parts)
            self._remove_files()
            pytest.fail(head + "\n" + "\n".join(report), pytrace=False)
        return results

    def close(self, exits: dict[int, int] | None = None, timeout: float = 60.0) -> list[str]:
        """Ends every rank (destroy_process_group, exit); returns problems with exit codes."""
        exits = exits or {}
        if self.broken:
            return []
        self.ask_to_exit()
        self.broken = True
        problems = []
        deadline = time.monotonic() + timeout
        for r, p in enumerate(self.procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
                problems.append(f"rank {r} did not exit within {timeout:.0f} s after its last job (killed); "
                                f"its output:\n{self.output(r)}")
            elif p.exitcode != exits.get(r, 0):
                problems.append(f"rank {r} exited with {describe_exit(p.exitcode)}; its output:\n{self.output(r)}")
        self._remove_files()
        return problems

    def ask_to_exit(self) -> None:
        """Tells every rank to end after its current job (close() then waits for them)."""
        if self.broken or self.exit_asked:
            return
        self.exit_asked = True
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass

    def kill(self) -> None:
        """Kills every rank and removes the group's folder (logs, init file)."""
        self._stop()
        self._remove_files()

    def _stop(self) -> None:
        self.broken = True
        self.ranks.kill()  # every rank's process group

    def _remove_files(self) -> None:
        """The group's folder goes once nothing reads its logs any more: after a failure's report is
        built, or when the group is closed or killed."""
        self.ranks.remove_folder()


_POOLS: dict[tuple, RankGroup] = {}


def pool(key: tuple, world_size: int, kind: RankKind, base_env: dict | None = None, daemon: bool = False) -> RankGroup:
    """The persistent group of `key`, started anew when there is none or the last one broke."""
    group = _POOLS.get(key)
    if group is None or group.broken:
        group = _POOLS[key] = RankGroup(world_size, kind, base_env, daemon=daemon)
    return group


def close_pools() -> None:
    # Every pool's ranks tear down at the same time (each takes seconds: destroy_process_group, exit).
    for group in _POOLS.values():
        group.ask_to_exit()
    for group in _POOLS.values():
        group.close()
    _POOLS.clear()


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    transport: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs fn(rank, world_size, *args, **kwargs) on the persistent pool of the place `transport`
    ("shm", "tcp" or "cuda"; default: the test's, Note [Places]); returns per-rank results."""
    within_deadline(timeout)  # past the run's deadline: skip before any process starts
    place = transport or DEFAULT_PLACE
    kind, base_env = place_kind(place)
    group = pool((place, world_size), world_size, kind, {**base_env, PLACE_VAR: place}, daemon=True)
    return group.run(fn, args, kwargs, dict(env or {}), timeout, {})


# The places other than the CPU transports: a RankKind and the pool's environment for each
# (tests/gpu/gpu_ranks.py registers "cuda").
_PLACE_KINDS: dict[str, Callable[[], tuple[RankKind, dict]]] = {}


def register_place(place: str, make: Callable[[], tuple[RankKind, dict]]) -> None:
    _PLACE_KINDS[place] = make


def place_kind(place: str) -> tuple[RankKind, dict]:
    """The RankKind of a pool at `place` and the environment its processes start with."""
    if place in TRANSPORTS:
        return RankKind(), {"RINGREDUCE_SHM": TRANSPORTS[place]}
    if place not in _PLACE_KINDS:
        raise ValueError(f"unknown place {place!r} (one of {ALL_PLACES}; tests/gpu/gpu_ranks.py registers cuda)")
    return _PLACE_KINDS[place]()


def run_fresh(world_size: int, kind: RankKind, fn: Callable[..., Any], args: tuple, env: dict | None,
              timeout: float, exits: dict[int, int] | None) -> list[Any]:
    """Runs fn on fresh processes (`env` set as they start) and fails the test unless every rank then
    exits with code 0, or exits[rank] (such a rank may also die without a result: None)."""
    group = RankGroup(world_size, kind, env)
    try:
        results = group.run(fn, args, {}, {}, timeout, exits or {})
    except BaseException:
        group.kill()
        raise
    problems = group.close(exits)
    if problems:
        pytest.fail(f"{fn.__name__}: after the job\n" + "\n".join(problems), pytrace=False)
    return results


def spawn_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    pg_timeout: float = 60.0,
) -> list[tuple[str, Any, int | None]]:
    """Runs fn on fresh CPU processes (RINGREDUCE_SHM from the test's place unless `env` sets it), which
    exit after it. Returns per rank (status, result-or-traceback, exit code).

    status is "ok", "err" (fn raised) or "died" (no result: killed or crashed). Startup (at most
    STARTUP_S) is not charged to `timeout`, as for the pools: a loaded machine can take a minute to
    start torch in every rank. Every process is killed at the deadline; the caller asserts on statuses
    and exit codes. What the ranks printed goes to this process's stderr (pytest shows it when the
    test fails).
    """
    within_deadline(timeout)  # past the run's deadline: skip before any process starts
    env = {"RINGREDUCE_SHM": TRANSPORTS.get(DEFAULT_PLACE, "1"), **(env or {})}
    group = RankGroup(world_size, RankKind(pg_timeout), env, one_job=True)
    try:
        group.wait_ready(fn)
        timeout, _ = within_deadline(timeout)
        deadline = time.monotonic() + timeout
        results, errors, dead, pending = group.collect(fn, args, {}, {}, deadline - time.monotonic(), {}, None)
        for p in group.procs:  # its exit code once it exited (atexit handlers included)
            p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        for r in range(world_size):
            if text := group.output(r, False):
                sys.stderr.write(f"--- rank {r} of {fn.__name__}: its output ---\n{text}\n")
    finally:
        group.kill()
    return [("err", errors[r], p.exitcode) if r in errors else
            ("died", None, p.exitcode) if r in dead or r in pending else
            ("ok", results[r], p.exitcode) for r, p in enumerate(group.procs)]


CXX_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cpp|h|cu|cuh):\d+\]")


def expect_raises(fn: Callable[[], Any], exc_type: type[BaseException], *needles: str) -> str:
    """"ok" if fn() raises exc_type with every needle in its message, else what happened instead
    (returned, not raised, so a rank reports every case of a multi-rank test at once). The message
    must not end in a C++ source location: those are for internal errors only (Note [Where an error
    was thrown] in csrc/core/error.h)."""
    try:
        fn()
    except exc_type as exc:
        missing = [n for n in needles if n not in str(exc)]
        if missing:
            return f"message lacks {missing}: {exc}"
        if CXX_LOCATION.search(str(exc)):
            return f"message of a user-facing error names a C++ source line: {exc}"
        return "ok"
    except BaseException as exc:  # noqa: BLE001 - reported
        return f"raised {type(exc).__name__} instead of {exc_type.__name__}: {exc}"
    return f"did not raise {exc_type.__name__}"
