"""Local rank processes, started one way for the benchmark (ringreduce/bench/launch.py), the tests
(tests/ranks.py, and tests/gpu/gpu_ranks.py above it) and the GPU checks (scripts/gpu_review_checks.py).

``RankProcesses(n).start(target, args_of)`` runs ``target(*args_of(rank))`` in n processes forked from
multiprocessing's forkserver with torch and ringreduce imported (Note [Ranks from a forkserver]; a
non-zero int `target` returns is the exit code), each rank:

* with the environment of the process that started it and its own (``env``: a dict for every rank, or
  a function of the rank), set before `target` runs; ``reload_knobs()`` is called when ringreduce has one, so that knobs set here reach
  the library however early it was imported;
* in a process group of its own, killed whole (the rank's own children too) by ``kill()`` and at
  the end of ``wait()``'s timeout; the kernel kills a rank whose parent dies (PR_SET_PDEATHSIG), so
  none outlives a killed driver;
* with its output in ``rank<r>.log`` of the group's temporary folder (``log=True``; the folder also
  holds ``init_file`` for a ``file://`` rendezvous and anything the caller puts there), faulthandler
  writing a crash's Python stack there and, on SIGUSR1 (``dump_stacks()``), every thread's stack.

``wait(timeout, grace)`` polls the exit codes: once a rank exited with a non-zero code the others get
`grace` seconds, then every rank still running is killed; at the timeout too. ``close()`` kills what
is left and removes the folder; ``shm_left(before)`` names ringreduce's segments that appeared in
/dev/shm since `before` (``shm_entries()``). ``free_port()`` and ``launcher_env()`` give the env://
variables of a torchrun-like launch. ``stop_session(p, grace)`` stops a launcher (torchrun, ``ip netns
exec``) started in a session of its own.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

# Note [Ranks from a forkserver]: a rank is forked from multiprocessing's forkserver, which imported torch,
# torch.distributed, torch._dynamo (what DDP imports at its first use) and ringreduce once (no CUDA, no
# ring, no thread of theirs: nothing a fork could not copy), instead of a new interpreter importing them
# again: 2 ranks with a gloo group are ready in 2-3 s instead of 50-98 s on the 2-vCPU VM at load 20 (the
# first group pays the forkserver's own start). Each rank gets the environment its parent had when it
# started the rank (as a spawned one would), then its own; the knobs are reloaded after.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ringreduce"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx
_PR_SET_PDEATHSIG = 1
SHM_PREFIX = "ringreduce"  # the names of ringreduce's segments in /dev/shm (Note [Shared-memory segments])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def describe_exit(code: int | None) -> str:
    """'exit code 3', 'SIGSEGV (exit code -11)', 'still running'."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"{name} (exit code {code})"


def stop_session(p: Any, grace: float = 5.0) -> None:
    """Stops the subprocess.Popen `p`, started with start_new_session=True: SIGTERM to its session, then,
    after `grace` s, SIGKILL to what is left of it. torchrun starts each worker in a session of its own and
    stops them only when it is asked to (SIGTERM: its workers get SIGTERM, then SIGKILL after 30 s), so a
    torchrun killed outright leaves its workers running: give it a `grace` past those 30 s."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=grace)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # also what is left of the session once `p` is gone
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def launcher_env(rank: int, world_size: int, port: int, local_size: int | None = None) -> dict[str, str]:
    """torchrun's variables for `rank` of `world_size` on 127.0.0.1:`port` (env://); with `local_size`,
    nodes of that many consecutive ranks simulated on this host (GROUP_RANK, RINGREDUCE_LOCAL_SIZE)."""
    local = local_size or world_size
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GLOO_SOCKET_IFNAME": "lo"}
    if local_size is not None:
        env.update(GROUP_RANK=str(rank // local_size), RINGREDUCE_LOCAL_SIZE=str(local_size))
    return env


def shm_entries() -> set[str]:
    """ringreduce's segments in /dev/shm now."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def shm_left(before: set[str]) -> list[str]:
    """ringreduce's segments in /dev/shm that were not there `before` (a rank killed mid-setup can leave
    one; Note [Shared-memory segments] unlinks a segment once every rank has mapped it)."""
    return sorted(shm_entries() - before)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's kill() still ends the rank
        pass


def _bootstrap(target: Callable[..., Any], args: tuple, env: dict[str, str], log_path: str | None) -> None:
    os.setpgid(0, 0)  # a process group of its own: kill() ends the rank's children with it
    _die_with_parent()
    os.environ.clear()  # the starting process's environment, not the forkserver's (Note [Ranks from a forkserver])
    if log_path is not None:
        log = open(log_path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        faulthandler.enable(log)
        faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # dump_stacks()
    os.environ.update(env)
    reload = getattr(sys.modules.get("ringreduce"), "reload_knobs", None)
    if reload is not None:
        reload()
    try:
        code = target(*args)
    finally:
        # A forked process ends in os._exit, which skips atexit; a rank ends as an interpreter does
        # (as a spawned one did), its atexit handlers run: ringreduce's drains its pending calls there.
        atexit._run_exitfuncs()
    sys.exit(code if isinstance(code, int) else 0)


class RankProcesses:
    """`world_size` spawned rank processes (see the module docstring): the folder is made here, the
    processes by ``start(target, args_of, env)``, which runs ``target(*args_of(rank))`` on each."""

    def __init__(self, world_size: int, name: str = "rank", prefix: str = "rr_ranks_", log: bool = True) -> None:
        self.world_size = world_size
        self.name = name
        self.folder = tempfile.mkdtemp(prefix=prefix)
        self.init_file = os.path.join(self.folder, "init")
        self.logs = [os.path.join(self.folder, f"rank{r}.log") if log else None for r in range(world_size)]
        self.procs: list[Any] = []

    def start(self, target: Callable[..., Any], args_of: Callable[[int], tuple],
              env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
              daemon: bool = False) -> RankProcesses:
        ctx = _context()
        for r in range(self.world_size):
            rank_env = {**os.environ, **{k: str(v) for k, v in (env(r) if callable(env) else (env or {})).items()}}
            p = ctx.Process(target=_bootstrap, name=f"{self.name} {r}", daemon=daemon,
                            args=(target, args_of(r), rank_env, self.logs[r]))
            p.start()
            self.procs.append(p)
        return self

    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def output(self, rank: int, offset: int = 0, tail: int | None = None) -> str:
        """What rank `rank` printed from byte `offset` of its log (its last `tail` characters)."""
        path = self.logs[rank]
        if path is None:
            return ""
        try:
            with open(path, errors="replace") as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            return ""
        return text[-tail:] if tail is not None and len(text) > tail else text

    def log_size(self, rank: int) -> int:
        path = self.logs[rank]
        try:
            return os.path.getsize(path) if path is not None else 0
        except OSError:
            return 0

    def dump_stacks(self, ranks: Any = None) -> None:
        """Every thread's Python stack of the ranks still running into their logs (faulthandler)."""
        for r in range(self.world_size) if ranks is None else ranks:
            p = self.procs[r]
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float | None, grace: float = 10.0, on_failure: Callable[[int, int], None] | None = None,
             poll: float = 0.05) -> list[int | None]:
        """Waits until every rank exited; `grace` s after the first non-zero exit (on_failure(rank, code)
        is told of it), or at `timeout`, kills the ranks still running. Returns the exit codes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at: float | None = None
        while True:
            codes = self.exit_codes()
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed_at is None:
                failed_at = now
                if on_failure is not None:
                    on_failure(*bad[0])
            if (deadline is not None and now > deadline) or (failed_at is not None and now - failed_at > grace):
                self.kill()
                break
            time.sleep(poll)
        for p in self.procs:
            p.join(timeout=5)
        return self.exit_codes()

    def kill(self) -> None:
        """SIGKILL to every running rank's process group (the rank and its children), then joins them."""
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # not yet its own group leader
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for p in self.procs:
            p.join(timeout=10)

    def remove_folder(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        """Kills what still runs and removes the folder (logs, init file)."""
        self.kill()
        self.remove_folder()

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
