"""Ranks for the GPU tests: one process per rank over an NCCL (+ gloo for CPU tensors) process group.

``run_gpu_ranks(fn, *args, world_size=None, env=None, timeout=300, set_device=True, fresh=False,
exits=None)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the per-rank results.
``fn`` must be a module-level function.

* **World size and devices** (Note [Ranks sharing a GPU], ringreduce/bench/gpu_map.py): the world
  size is ``RINGREDUCE_GPU_WORLD``, else one rank per visible GPU, or 2 ranks on a single GPU. Rank
  r runs on GPU r % GPUs (``torch.cuda.set_device`` unless ``set_device=False``); tests take their
  device from ``device(rank)``, never ``cuda:rank``. Where ranks outnumber GPUs each rank gets its
  own ``NCCL_HOSTID`` and NCCL connects them with its socket transport over ``lo`` (``transport()``
  says which; ``need_distinct_gpus`` skips a test that needs a GPU per rank).
* **Processes**: by default a persistent pool per (world size, set_device) runs one test after
  another (``env`` is applied per job and restored); ``fresh=True`` spawns new processes for the
  one job and checks that every rank exits with code 0 after it (for tests that poison their group,
  read knobs at communicator creation such as ``RINGREDUCE_TIMEOUT``, or test process exit).
  ``exits={rank: code}`` (fresh only) lets those ranks die with that exit code without a result.
* **Failures are reported at once**: the parent polls every rank's pipe and exit code; a rank that
  dies (a signal, an unexpected exit) fails the test within a second or two with its exit code, the
  signal's name and the tail of what it printed (each rank's stdout and stderr go to a log file;
  faulthandler prints the Python stack of a crash there), after the other ranks got a few seconds
  to report. A rank that raises fails the test with its traceback; a job that exceeds ``timeout`` is
  killed after every rank printed the Python stacks of its threads (faulthandler on SIGUSR1), so a
  hang says where it hung. Either way the pool is discarded.
* **A deadline for the whole run**: ``RINGREDUCE_GPU_DEADLINE`` (Unix time; scripts/gpu_check.sh
  sets it a little before its step's limit) shortens every job's timeout and the ranks' startup to
  what is left before it, so a hang is reported, stacks and all, before the step's own limit kills
  pytest and with it every rank; once it has passed, the remaining tests skip.

``device="cpu"`` runs the same machinery over gloo alone without touching CUDA (the harness's own
tests, tests/tools/test_gpu_harness.py, run it on machines without a GPU).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ranks import job_environ

from ringreduce.bench.gpu_map import gpu_world_size, nccl_rank_env, nccl_transport_label, rank_device, ranks_share_gpus

_CTX = mp.get_context("spawn")
GRACE_S = 5.0  # after a rank died: how long the others may still report before they are killed
STARTUP_S = 180.0  # process start and process group creation, before the first job
LOG_TAIL = 4000  # characters of a failed rank's output in the report
PG_TIMEOUT = datetime.timedelta(seconds=120)
DEADLINE_VAR = "RINGREDUCE_GPU_DEADLINE"  # Unix time by which every job must have ended (gpu_check.sh's step limit)


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


def _within_deadline(seconds: float) -> tuple[float, str]:
    """`seconds`, shortened to the time left before the run's deadline, and what limited it ("" when
    not the deadline); skips the test when the deadline has passed."""
    left = time_left()
    if left is None or left >= seconds:
        return seconds, ""
    if left < 1.0:
        pytest.skip(f"not run: the deadline of this run ({DEADLINE_VAR}, scripts/gpu_check.sh's step limit) has passed")
    return left, f", all that was left before {DEADLINE_VAR}"


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world() -> int:
    """The GPU tests' world size (RINGREDUCE_GPU_WORLD, else the GPU count, or 2 on one GPU)."""
    return gpu_world_size(os.environ, visible_gpus())


def device(rank: int) -> torch.device:
    """Rank `rank`'s GPU (round-robin over the visible GPUs)."""
    return torch.device("cuda", rank_device(rank, visible_gpus()))


def shared() -> bool:
    """Whether ranks of the configured world share GPUs (NCCL's socket transport over lo)."""
    return ranks_share_gpus(world(), visible_gpus())


def transport(world_size: int | None = None) -> str:
    return nccl_transport_label(world_size or world(), visible_gpus())


def need_gpus(n: int = 1):
    return pytest.mark.skipif(visible_gpus() < n, reason=f"needs >= {n} CUDA GPUs (found {visible_gpus()})")


def need_world(n: int):
    """Skips unless the configured world size (RINGREDUCE_GPU_WORLD; ranks may share GPUs) is >= n."""
    gpus = visible_gpus()
    return pytest.mark.skipif(
        gpus == 0 or world() < n,
        reason=f"needs >= {n} ranks (world size {world()} on {gpus} GPUs; set RINGREDUCE_GPU_WORLD={n})",
    )


def need_distinct_gpus(n: int = 2):
    """Skips unless every rank of the configured world has a GPU of its own (and there are >= n)."""
    gpus = visible_gpus()
    return pytest.mark.skipif(
        gpus < n or shared(),
        reason=f"needs a GPU per rank (>= {n}); {world()} ranks share {gpus} GPU(s) here",
    )


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int | None) -> str:
    """'exit code 3', 'SIGSEGV (exit code -11)', 'still running'."""
    if code is None:
        return "still running"
    name = _signal_name(code)
    return f"{name} (exit code {code})" if name else f"exit code {code}"


# ---- the rank processes -----------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, init_file: str, log_path: str, conn: Any, sys_path: list[str],
               base_env: dict, on_cuda: bool, set_device: bool) -> None:
    # Everything this rank prints goes to its log (the parent reports its tail when the rank fails);
    # faulthandler writes the Python stack of a fatal signal there too.
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(log)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # the parent asks before killing a hung rank
    sys.path[:] = sys_path
    os.environ.update(base_env)
    try:
        import torch.distributed as dist

        if on_cuda:
            gpus = torch.cuda.device_count()
            os.environ.update(nccl_rank_env(rank, world_size, gpus))
            if set_device:
                torch.cuda.set_device(rank_device(rank, gpus))
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=PG_TIMEOUT)
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
        fn, args, env = job
        try:
            with job_environ(env):
                result = fn(rank, world_size, *args)
                if on_cuda:
                    torch.cuda.synchronize(rank_device(rank, torch.cuda.device_count()))
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankGroup:
    """`world_size` rank processes with a process group, running jobs until closed."""

    def __init__(self, world_size: int, on_cuda: bool, set_device: bool, base_env: dict | None = None) -> None:
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="rr_gpu_ranks_")
        init_file = os.path.join(self.tmp, "init")
        self.logs = [os.path.join(self.tmp, f"rank{r}.log") for r in range(world_size)]
        self.offsets = [0] * world_size  # where the current job's output starts in each log
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.broken = False
        self.ready = False
        for r in range(world_size):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(target=_rank_main, name=f"gpu rank {r}",
                             args=(r, world_size, init_file, self.logs[r], child, list(sys.path),
                                   dict(base_env or {}), on_cuda, set_device))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def output(self, rank: int, since_job: bool = True) -> str:
        try:
            with open(self.logs[rank], errors="replace") as f:
                f.seek(self.offsets[rank] if since_job else 0)
                text = f.read()
        except OSError:
            return ""
        return text[-LOG_TAIL:] if len(text) > LOG_TAIL else text

    def _wait_ready(self, fn: Callable) -> None:
        """Every rank has its process group (startup is not charged to the first job's timeout)."""
        startup_s, _ = _within_deadline(STARTUP_S)
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
                problems.append(f"--- rank {r} did not start: {what}; its output:\n{self.output(r, False) or '(nothing)'}")
        if problems:
            self.kill()
            pytest.fail(f"{fn.__name__}: the ranks did not start\n" + "\n".join(problems), pytrace=False)
        self.ready = True

    def run(self, fn: Callable, args: tuple, env: dict, timeout: float, exits: dict[int, int]) -> list[Any]:
        if not self.ready:
            self._wait_ready(fn)
        timeout, cut = _within_deadline(timeout)
        for r in range(self.world_size):
            try:
                self.offsets[r] = os.path.getsize(self.logs[r])
            except OSError:
                self.offsets[r] = 0
            self.conns[r].send((fn, args, env))
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        dead: dict[int, int | None] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        first_failure: float | None = None  # a rank died or raised: the others get GRACE_S to report
        while pending:
            now = time.monotonic()
            if now > deadline or (first_failure is not None and now - first_failure > GRACE_S):
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
        if pending and not (dead or errors):  # a hang: where is every rank stuck? (Python stacks)
            for r in pending:
                if self.procs[r].is_alive() and self.procs[r].pid is not None:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
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
        self.broken = True
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
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

    def kill(self) -> None:
        """Kills every rank and removes the group's folder (logs, init file)."""
        self._stop()
        self._remove_files()

    def _stop(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)

    def _remove_files(self) -> None:
        """The group's rr_gpu_ranks_* folder goes once nothing reads its logs any more: after a
        failure's report is built, or when the group is closed or killed."""
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOLS: dict[tuple, RankGroup] = {}


def close_pools() -> None:
    for group in _POOLS.values():
        group.close()
    _POOLS.clear()


def run_gpu_ranks(fn: Callable, *args: Any, world_size: int | None = None, env: dict | None = None,
                  timeout: float = 300.0, set_device: bool = True, fresh: bool = False,
                  exits: dict[int, int] | None = None, device: str = "cuda") -> list[Any]:
    """Runs fn(rank, world_size, *args) on every rank; returns the per-rank results (None for ranks
    that died as `exits` allowed). See the module docstring."""
    on_cuda = device == "cuda"
    n = world_size or (world() if on_cuda else 2)
    if on_cuda and visible_gpus() == 0:
        pytest.fail("run_gpu_ranks needs a CUDA GPU", pytrace=False)
    if exits and not fresh:
        raise ValueError("exits= needs fresh=True: a pool rank that exits is gone")
    _within_deadline(timeout)  # past the run's deadline: skip before any process starts
    if fresh:
        group = RankGroup(n, on_cuda, set_device, env)
        try:
            results = group.run(fn, args, {}, timeout, exits or {})
        except BaseException:
            group.kill()
            raise
        problems = group.close(exits)
        if problems:
            pytest.fail(f"{fn.__name__}: after the job\n" + "\n".join(problems), pytrace=False)
        return results
    key = (n, on_cuda, set_device)
    group = _POOLS.get(key)
    if group is None or group.broken:
        group = RankGroup(n, on_cuda, set_device)
        _POOLS[key] = group
    return group.run(fn, args, dict(env or {}), timeout, {})
