"""Multi-process test harness: gloo ranks on loopback, with kill timeouts and exit codes checked.

``run_ranks(n, fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank of a persistent pool
of n processes (one pool per world size and CPU transport, reused across tests so the suite stays
fast) and returns the per-rank results. The transport (``transport="shm"`` or ``"tcp"``, default
DEFAULT_TRANSPORT, which conftest.py sets for modules that run over both) is fixed when a pool
starts: a ring decides on shared memory at its first call (RINGREDUCE_SHM). ``fn`` must be a module-level function of an importable module (a test file).
If any rank raises, the test fails with every rank's traceback; if the ranks do not finish within
``timeout`` seconds the pool is killed and the test fails. ``spawn_ranks`` runs one job on fresh
processes (for tests that kill ranks or poison their groups) and reports exit codes.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

_CTX = mp.get_context("spawn")
DEFAULT_TIMEOUT = 180.0
TRANSPORTS = {"shm": "1", "tcp": "0"}  # RINGREDUCE_SHM of a pool's processes
DEFAULT_TRANSPORT = "shm"  # the library's default for ranks of one host


@contextlib.contextmanager
def job_environ(env: dict) -> Iterator[None]:
    """os.environ with `env` set (values as strings) for one job of a rank, as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, init_file: str, pg_timeout: float) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )


def _pool_main(rank: int, world_size: int, init_file: str, conn: Any, sys_path: list[str], pg_timeout: float,
               shm: str) -> None:
    sys.path[:] = sys_path
    os.environ["RINGREDUCE_SHM"] = shm
    import torch

    torch.set_num_threads(1)
    _init(rank, world_size, init_file, pg_timeout)
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
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


class RankPool:
    def __init__(self, world_size: int, pg_timeout: float = 60.0, transport: str = "shm") -> None:
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="rr_pool_")
        init_file = os.path.join(self.tmp, "init")
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(
                target=_pool_main,
                args=(rank, world_size, init_file, child, list(sys.path), pg_timeout, TRANSPORTS[transport]),
                daemon=True,
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.broken = False

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict, timeout: float) -> list[Any]:
        for c in self.conns:
            c.send((fn, args, kwargs, env))
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise AssertionError(
                    f"ranks {sorted(pending)} of {self.world_size} did not finish {fn.__name__} within "
                    f"{timeout:.0f} s (pool killed)" + _fmt_errors(errors)
                )
            for r in list(pending):
                if self.conns[r].poll(min(left, 0.05)):
                    try:
                        status, payload = self.conns[r].recv()
                    except (EOFError, OSError):
                        self.kill()
                        raise AssertionError(
                            f"rank {r} died (exit code {self.procs[r].exitcode}) while running {fn.__name__}"
                            + _fmt_errors(errors)
                        ) from None
                    pending.discard(r)
                    if status == "ok":
                        results[r] = payload
                    else:
                        errors[r] = payload
                elif not self.procs[r].is_alive():
                    self.kill()
                    raise AssertionError(
                        f"rank {r} died (exit code {self.procs[r].exitcode}) while running {fn.__name__}"
                        + _fmt_errors(errors)
                    )
        if errors:
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}" + _fmt_errors(errors))
        return results

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)  # the rendezvous file: nothing left in /tmp

    def close(self) -> None:
        if self.broken:
            return
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.broken = True
        shutil.rmtree(self.tmp, ignore_errors=True)


def _fmt_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))


_POOLS: dict[tuple[int, str], RankPool] = {}


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    transport: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs fn(rank, world_size, *args, **kwargs) on a persistent pool; returns per-rank results."""
    key = (world_size, transport or DEFAULT_TRANSPORT)
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        pool = RankPool(world_size, transport=key[1])
        _POOLS[key] = pool
    try:
        return pool.run(fn, args, kwargs, env or {}, timeout)
    except AssertionError:
        # A failed job may leave a rank blocked in a collective: start the next test on fresh ranks.
        pool.kill()
        raise


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _spawn_main(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, env: dict,
                sys_path: list[str], pg_timeout: float, conn: Any) -> None:
    sys.path[:] = sys_path
    os.environ.update({k: str(v) for k, v in env.items()})
    import torch

    torch.set_num_threads(1)
    _init(rank, world_size, init_file, pg_timeout)
    try:
        conn.send(("ok", fn(rank, world_size, *args)))
    except BaseException as exc:  # noqa: BLE001
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def spawn_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    pg_timeout: float = 60.0,
) -> list[tuple[str, Any, int | None]]:
    """Runs fn on fresh processes (RINGREDUCE_SHM from DEFAULT_TRANSPORT unless `env` sets it).
    Returns per rank (status, result-or-traceback, exit code).

    status is "ok", "err" (fn raised) or "died" (no result: killed or crashed). Every process is
    killed at the deadline; the caller asserts on statuses and exit codes.
    """
    tmp = tempfile.mkdtemp(prefix="rr_spawn_")
    init_file = os.path.join(tmp, "init")
    env = {"RINGREDUCE_SHM": TRANSPORTS[DEFAULT_TRANSPORT], **(env or {})}
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = _CTX.Pipe()
        p = _CTX.Process(
            target=_spawn_main,
            args=(rank, world_size, init_file, fn, args, env or {}, list(sys.path), pg_timeout, child),
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    out: list[tuple[str, Any, int | None]] = [("died", None, None)] * world_size
    deadline = time.monotonic() + timeout
    for r, (p, c) in enumerate(zip(procs, conns, strict=True)):
        left = max(0.0, deadline - time.monotonic())
        got = None
        if c.poll(left):
            try:
                got = c.recv()
            except (EOFError, OSError):
                got = None
        p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        out[r] = (got[0], got[1], p.exitcode) if got else ("died", None, p.exitcode)
    for p in procs:  # a rank that the loop above let go may still be exiting
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


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
