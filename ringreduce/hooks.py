"""Gradient averaging overlapped with backward: GradientAverager and a DDP communication hook.

Note [Buckets and launch order]
    Parameters that require grad are packed, in reverse registration order (roughly the order in
    which backward produces their gradients), into flat buckets, one dtype and device per bucket.
    The first bucket of each (dtype, device) is capped at ``first_bucket_mb`` so that communication
    starts early; the others at ``bucket_cap_mb``. The assignment depends only on the parameter
    list, so it is identical on every rank. A bucket is *ready* when every one of its parameters
    has had its gradient accumulated in this backward (a post-accumulate-grad hook); ready buckets
    are launched as asynchronous ringreduce AVG all-reduces **strictly in bucket-index order**:
    post-accumulate-grad hooks fire in different orders on different ranks, and an out-of-order
    launch would pair rank A's bucket 2 with rank B's bucket 1.

Note [End of backward]
    The first hook of a synced backward queues a callback on the autograd engine. It launches
    the buckets that never became ready (their missing gradients as zeros), waits for every bucket
    and writes the averages back. Under reentrant activation checkpointing the inner backward is a
    separate graph task whose callbacks run when the *inner* backward ends, while the outer one is
    still going. Such a callback sees the outer node still executing
    (``torch._C._current_autograd_node()`` is not None); it does not finish the round but puts a
    post-hook on that outer node, which queues the callback again, this time on the outer graph
    task.

Note [Unused parameters]
    A parameter is *used* on a rank when its gradient was accumulated since the last synced
    backward (no_sync steps included). The used flags ride as extra elements of the last bucket
    (AVG of 0/1 flags is non-zero iff some rank used the parameter), so deciding costs no extra
    round trip. Parameters used by some rank get the average on every rank (a rank without a
    gradient contributes zeros); parameters no rank used keep their gradient untouched (None stays
    None), as DDP with ``find_unused_parameters=True`` does. The last bucket is launched only after
    all earlier ones, i.e. when all hooks have fired or at the end of backward, so its flags are
    final when it goes out.

Note [Uneven inputs]
    The Join protocol (torch.distributed.algorithms.join), as DDP follows it, with one backward as
    one iteration. An active rank's first gradient hook of each backward calls
    ``Join.notify_join_context`` (an all-reduce of 1: "still training", plus the early-termination
    all-reduce when asked for) and then all-reduces its sync flag (1 unless in ``no_sync``). A rank
    that ran out of inputs sits in ``Join.__exit__``, which all-reduces 0 against the first and
    calls main_hook: it all-reduces 0 against the flag, and if any rank syncs it launches one
    all-reduce of zeros per bucket, in bucket order, like the active ranks' buckets (same sizes,
    dtypes, op and accumulation, so the agreement frames match). The averages therefore sum the
    active ranks' gradients; divided by the group's size by default (AVG, as DDP's
    ``divide_by_initial_world_size=True``), or, with ``divide_by_initial_world_size=False``,
    summed (SUM on every rank) and divided by the number of syncing ranks, the flags' sum. Once every
    rank joined, post_hook agrees on a rank that joined last (an all-reduce MAX of candidate ranks)
    and broadcasts its parameters to every rank, since the others stopped stepping, as DDP does.

Note [DTensor gradients]
    A DTensor parameter is bucketed by its local shard (shape, dtype and device of its local
    tensor); its gradient's local shard is copied into the bucket and the average is written back
    into that shard in place, so the gradient stays the same DTensor with the same placements (a
    gradient the averager creates, for a parameter this rank did not use, gets the parameter's
    placements). With ``gradient_as_bucket_view=True`` the gradient is a DTensor whose local
    shard is the bucket slot. Averaging local shards is right for Shard and Replicate placements,
    and for Partial placements on mesh dimensions that are *not* averaged (the average commutes
    with the pending sum). A Partial placement on an averaged dimension would mix two reductions
    of the same ranks: such a gradient raises RuntimeError.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from ringreduce._dispatch import local_tensor, refuse_call, run_all_reduce
from ringreduce._groups import _is_device_mesh, resolve
from ringreduce._types import CallKind
from ringreduce.ops import ReduceOp, all_reduce
from ringreduce.work import Work

_MB = 1024 * 1024
_HALF_TYPES = (torch.float16, torch.bfloat16)
_WIRE_TYPES = (torch.bfloat16, torch.float16)
_NO_GROUP = object()
_OPS = {"avg": ReduceOp.AVG, "sum": ReduceOp.SUM}


def _check_op(op: Any, who: str) -> ReduceOp:
    """"avg"/"sum" (or ReduceOp.AVG/SUM) as a ReduceOp; anything else is a ValueError naming `who`."""
    if isinstance(op, str) and op.strip().lower() in _OPS:
        return _OPS[op.strip().lower()]
    if isinstance(op, ReduceOp) and op in (ReduceOp.AVG, ReduceOp.SUM):
        return op
    raise ValueError(f"ringreduce.{who}: op must be \"avg\" or \"sum\", got {op!r}")


def _check_scaling(wire_dtype: Any, predivide_factor: Any, who: str) -> None:
    """The checks of wire_dtype and predivide_factor that need no tensor (ringreduce.all_reduce
    makes the rest, on every rank alike)."""
    if wire_dtype is not None and wire_dtype not in _WIRE_TYPES:
        raise (ValueError if isinstance(wire_dtype, torch.dtype) else TypeError)(
            f"ringreduce.{who}: wire_dtype must be torch.bfloat16, torch.float16 or None, got {wire_dtype!r}"
        )
    if predivide_factor is not None:
        if isinstance(predivide_factor, bool) or not isinstance(predivide_factor, (int, float)):
            raise TypeError(f"ringreduce.{who}: predivide_factor must be a number > 0 or None, got "
                            f"{type(predivide_factor).__name__}")
        if not math.isfinite(predivide_factor) or predivide_factor <= 0:
            raise ValueError(f"ringreduce.{who}: predivide_factor must be a finite number > 0, got {predivide_factor!r}")


@dataclass
class _Bucket:
    index: int
    dtype: torch.dtype
    device: torch.device
    params: list[int]  # indices into GradientAverager._params
    offsets: list[int]
    numel: int  # gradient elements (the flags, if any, follow them)
    buffer: torch.Tensor | None = None
    pending: int = 0
    launched: bool = False
    work: Work | None = None
    flags: int = 0  # number of used-flag elements after the gradients (last bucket only)


def _collect_params(module_or_params: Any) -> list[torch.nn.Parameter]:
    if isinstance(module_or_params, torch.nn.Module):
        candidates: Iterable[Any] = module_or_params.parameters()
    elif isinstance(module_or_params, torch.Tensor):
        candidates = [module_or_params]
    else:
        try:
            candidates = list(module_or_params)
        except TypeError:
            raise TypeError(
                "ringreduce.GradientAverager: expected an nn.Module or an iterable of parameters, got "
                f"{type(module_or_params).__name__}"
            ) from None
    seen: set[int] = set()
    params = []
    for p in candidates:
        if isinstance(p, dict) and "params" in p:  # optimizer-style parameter groups
            raise TypeError(
                "ringreduce.GradientAverager: pass the module or a flat iterable of parameters, not "
                "optimizer parameter groups"
            )
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ringreduce.GradientAverager: expected parameters (tensors), got {type(p).__name__}")
        if not p.requires_grad or id(p) in seen:  # tied parameters are averaged once
            continue
        if not p.is_leaf:
            raise ValueError(
                "ringreduce.GradientAverager: every parameter must be a leaf tensor (an nn.Parameter or "
                "a tensor created with requires_grad=True); got a non-leaf tensor"
            )
        if p.layout != torch.strided:
            raise ValueError(f"ringreduce.GradientAverager: only dense parameters are supported, got {p.layout}")
        seen.add(id(p))
        params.append(p)
    return params


def _assign_buckets(
    params: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int
) -> list[tuple[torch.dtype, torch.device, list[int]]]:
    """Groups parameter indices into buckets: reverse order, per (dtype, device), capped in bytes.

    Returns the buckets in launch order (by the reverse position of their first parameter).
    """
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    done: list[tuple[int, torch.dtype, torch.device, list[int]]] = []
    order = list(range(len(params) - 1, -1, -1))
    position = {i: pos for pos, i in enumerate(order)}

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        members = open_.pop(key)
        size.pop(key)
        closed_count[key] = closed_count.get(key, 0) + 1
        done.append((position[members[0]], key[0], key[1], members))

    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(i)
        size[key] = size.get(key, 0) + p.numel() * p.element_size()
        limit = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if size[key] >= limit:
            close(key)
    for key in list(open_):
        close(key)
    done.sort(key=lambda b: b[0])
    return [(dtype, device, members) for _, dtype, device, members in done]


def _slot_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bucket slot of a parameter, shaped like it and with its memory layout when it is dense."""
    strides = torch.empty_like(like, device="meta").stride()  # dense strides in like's dim order
    return buffer.as_strided(like.shape, strides, buffer.storage_offset() + offset)


def _is_view_of(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        grad.data_ptr() == slot.data_ptr()
        and grad.shape == slot.shape
        and grad.stride() == slot.stride()
        and grad.dtype == slot.dtype
        and grad.device == slot.device
    )


def _is_dtensor(t: Any) -> bool:
    return t is not None and local_tensor(t) is not t


def _as_grad(local: torch.Tensor, param: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """`local` as the gradient of `param`: itself for a plain parameter; for a DTensor parameter a
    DTensor whose local shard is `local` (same memory), with the placements of `like` (the gradient
    it replaces) or else of `param`. See Note [DTensor gradients]."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    src = like if _is_dtensor(like) else param
    with torch.no_grad():
        return DTensor.from_local(
            local, src.device_mesh, src.placements, run_check=False, shape=src.shape, stride=src.stride()
        )


def _compiled_autograd_active() -> bool:
    """Whether a backward runs under compiled autograd (no module lookup costs more than a dict probe)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def _global_ranks(group: Any) -> frozenset[int]:
    """The global ranks `group` (None, a ProcessGroup or a DeviceMesh) averages over."""
    if group is None:
        return frozenset(range(dist.get_world_size()))
    if _is_device_mesh(group):
        return frozenset(int(r) for r in group.mesh.flatten().tolist())
    return frozenset(dist.get_process_group_ranks(group))


class GradientAverager(Joinable):
    """Averages gradients across the ranks of `group` while backward runs (ringreduce's ring).

    Registers a post-accumulate-grad hook on every parameter of `module_or_params` that requires
    grad (an ``nn.Module`` or an iterable of parameters; tied parameters count once). Gradients are
    packed into flat per-dtype, per-device buckets in reverse parameter order, ``first_bucket_mb``
    for the first and ``bucket_cap_mb`` for the others; each bucket is averaged with
    ``ringreduce.all_reduce(op=AVG, async_op=True)`` as soon as it and every bucket before it are
    complete, so communication overlaps the rest of backward. At the end of backward (an autograd
    callback; activation checkpointing, reentrant or not, is handled) the remaining buckets are
    launched, every bucket is waited for and ``.grad`` holds the average over ranks (on GPUs the
    caller's stream is ordered after the reductions). Every rank must run the same sequence of
    synced backwards, each reaching at least one of the parameters.

    - Parameters used on some ranks only get identical averaged gradients everywhere; parameters no
      rank used keep their ``.grad`` (None stays None). No extra round trip: see Note [Unused
      parameters].
    - ``no_sync()``: backwards inside it only accumulate locally; the next synced backward averages
      the accumulated gradients.
    - ``gradient_as_bucket_view=True``: ``.grad`` tensors are views into the bucket buffers (no
      extra gradient memory, no copy back), re-established after ``zero_grad(set_to_none=True)``.
    - ``accum_dtype=torch.float32``: float16/bfloat16 buckets carry float32 partial sums.
    - ``op="sum"``: the gradients are summed over ranks instead of averaged, which is what
      ``torch.nn.DataParallel`` gives (and what losses with ``reduction="sum"`` over the whole batch
      want); ``op="avg"`` (the default) is DDP's average.
    - ``predivide_factor=f``: each bucket is all-reduced with ringreduce.all_reduce's
      ``predivide_factor`` (gradients divided by f before the ring, the sum scaled once after): the
      result does not change, half-precision sums stay in range (Horovod's
      ``gradient_predivide_factor``).
    - ``wire_dtype=torch.bfloat16`` (or ``torch.float16``): float32 buckets travel as 16-bit
      partials with float32 sums per hop (ringreduce.all_reduce's ``wire_dtype``); buckets of other
      dtypes are reduced as they are. A model without float32 parameters raises ValueError.
    - ``accumulation_steps=G``: gradient accumulation without dividing the loss. Run G - 1
      backwards inside ``no_sync()`` and then one synced backward; the synced backward's reduction
      divides the accumulated gradients by G as well, in its one final scaling: ``op="avg"``
      divides the sum over ranks by n G (the mean over every micro-batch of every rank, when each
      loss is a mean over its micro-batch); ``op="sum"`` divides it by G (the sum over ranks of the
      mean over micro-batches). Backwards inside ``no_sync()`` are counted (at the end of each
      backward); a synced backward after any other number than G - 1 of them raises RuntimeError on
      every rank before a bucket is reduced (this rank refuses every bucket of the round, so the
      others raise too instead of waiting; the count is not checked under compiled autograd).
    - `group`: None (WORLD), a ProcessGroup or a DeviceMesh. ``mesh=`` names a DeviceMesh or
      sub-mesh (``mesh["dp"]``, ``mesh["dp", "cp"]``) to average across those mesh dimensions only,
      the same as ``group=mesh``; passing both `group` and `mesh` is a ValueError. Ranks that differ
      in the other dimensions (tensor-parallel peers) keep their own gradients.
    - DTensor parameters: gradients are averaged through their local shards, in place, and keep
      their placements (Note [DTensor gradients]; a Partial placement on an averaged mesh dimension
      raises RuntimeError).

    - Compiled autograd: the end-of-backward callback is not available there, so call
      ``synchronize()`` after each synced backward (``.grad`` holds the average afterwards).
    - Uneven inputs: the averager is a ``torch.distributed.algorithms.Joinable``. Under
      ``with Join([averager]):`` a rank that ran out of batches shadows the others' buckets with
      zeros until every rank is done, then every rank takes the parameters of a rank that joined
      last, as DDP under ``Join([ddp])`` (Note [Uneven inputs]). ``Join(...,
      divide_by_initial_world_size=False)`` divides by the number of ranks still training instead,
      and ``throw_on_early_termination=True`` raises RuntimeError on every rank as soon as one ran
      out. Each backward is one iteration.

    Raises RuntimeError when a parameter receives a gradient while its bucket from a previous
    backward is still being averaged (a second backward before the first was synchronized, e.g.
    after a backward that raised part way: call ``synchronize()`` first).
    """

    def __init__(
        self,
        module_or_params: Any,
        group: Any = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        gradient_as_bucket_view: bool = False,
        accum_dtype: torch.dtype | None = None,
        mesh: Any = None,
        op: str = "avg",
        predivide_factor: float | None = None,
        wire_dtype: torch.dtype | None = None,
        accumulation_steps: int = 1,
    ) -> None:
        """Registers the hooks. `module_or_params`, `group`, `bucket_cap_mb`, `first_bucket_mb`,
        `gradient_as_bucket_view`, `accum_dtype`, `mesh`, `op`, `predivide_factor`, `wire_dtype` and
        `accumulation_steps` are described in the class docstring; bad values raise ValueError or
        TypeError here."""
        super().__init__()  # Joinable: a disabled join config until a Join context sets one
        if mesh is not None:
            if group is not None:
                raise ValueError(
                    "ringreduce.GradientAverager: pass either group or mesh, not both (mesh=m is the same as "
                    "group=m)"
                )
            if not _is_device_mesh(mesh):
                raise TypeError(
                    "ringreduce.GradientAverager: mesh must be a torch.distributed.device_mesh.DeviceMesh (or a "
                    f"sub-mesh such as mesh['dp']), got {type(mesh).__name__}"
                )
            group = mesh
        if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(
                f"ringreduce.GradientAverager: bucket_cap_mb ({bucket_cap_mb}) and first_bucket_mb "
                f"({first_bucket_mb}) must be > 0"
            )
        if accum_dtype not in (None, torch.float32):
            raise TypeError(
                f"ringreduce.GradientAverager: accum_dtype must be None or torch.float32, got {accum_dtype}"
            )
        self.op = _check_op(op, "GradientAverager")
        _check_scaling(wire_dtype, predivide_factor, "GradientAverager")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(
                f"ringreduce.GradientAverager: accumulation_steps must be an int >= 1, got {accumulation_steps!r}"
            )
        resolve(group)  # a clear error now if torch.distributed is not initialized
        self.group = group
        self.accum_dtype = accum_dtype
        self.predivide_factor = predivide_factor
        self.wire_dtype = wire_dtype
        self.accumulation_steps = accumulation_steps
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self._params = _collect_params(module_or_params)
        # What is bucketed: the tensors themselves, or a DTensor's local shard (Note [DTensor gradients]).
        self._locals = [local_tensor(p) for p in self._params]
        self._averaged_ranks: frozenset[int] | None = None  # global ranks of `group`, when needed
        self._partial_dims: dict[tuple[int, int], bool] = {}
        cap = max(1, int(bucket_cap_mb * _MB))
        first_cap = max(1, min(cap, int(first_bucket_mb * _MB)))
        self._buckets: list[_Bucket] = []
        self._bucket_of: list[int] = [0] * len(self._params)
        self._slots: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        for index, (dtype, device, members) in enumerate(_assign_buckets(self._locals, cap, first_cap)):
            offsets, numel = [], 0
            for i in members:
                offsets.append(numel)
                numel += self._locals[i].numel()
                self._bucket_of[i] = index
            self._buckets.append(_Bucket(index, dtype, device, members, offsets, numel))
        if wire_dtype is not None and not any(b.dtype == torch.float32 for b in self._buckets):
            raise ValueError(
                f"ringreduce.GradientAverager: wire_dtype={wire_dtype} applies to float32 gradients, and this "
                f"model has none (dtypes {sorted({str(b.dtype) for b in self._buckets})}); drop wire_dtype"
            )
        if self._buckets:
            self._buckets[-1].flags = len(self._params)
        for b in self._buckets:
            b.buffer = torch.zeros(b.numel + b.flags, dtype=b.dtype, device=b.device)
            for i, off in zip(b.params, b.offsets, strict=True):
                self._slots[i] = _slot_view(b.buffer, off, self._locals[i])
        self._lock = threading.RLock()
        self._sync = True
        self._removed = False
        self._used = [False] * len(self._params)  # accumulated since the last synced backward
        self._ready = [False] * len(self._params)  # hook fired in the current round
        self._round = False  # a synced backward started and is not yet finished
        self._next = 0  # next bucket to launch
        self._callback_tasks: set[int] = set()
        # Note [Uneven inputs]: state of the Join protocol
        self._join_notified = False  # this backward told the Join context that this rank still trains
        self._join_works: list[Any] = []  # its all-reduces (waited for at the end of backward)
        self._join_flag: torch.Tensor | None = None  # the sum of the sync flags: ranks still syncing
        self._join_divide_by_initial = True
        self._round_divisor = 0  # > 0: this round sums, then divides by the ranks still training
        # accumulation_steps: backwards finished inside no_sync() since the last synced one, and
        # whether a no_sync backward is running now (its end counts it).
        self._accumulated = 0
        self._nosync_pending = False
        self._handles = []
        for i, p in enumerate(self._params):
            self._handles.append(p.register_hook(self._make_pre_hook(i)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_post_hook(i)))
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    if p.grad is not None:
                        self._slots[i].copy_(local_tensor(p.grad))
                        p.grad = _as_grad(self._slots[i], p, p.grad)

    # ----------------------------------------------------------------------------------- public

    @property
    def bucket_sizes(self) -> list[int]:
        """Elements per bucket in launch order (the used flags of the last bucket excluded)."""
        return [b.numel for b in self._buckets]

    @property
    def bucket_parameters(self) -> list[list[torch.Tensor]]:
        """The parameters of each bucket, in launch order."""
        return [[self._params[i] for i in b.params] for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally; the next synced backward averages them."""
        with self._lock:
            previous, self._sync = self._sync, False
        try:
            yield
        finally:
            with self._lock:
                self._sync = previous

    def synchronize(self) -> None:
        """Blocks until every bucket of the current synced backward is averaged into ``.grad``.

        Called automatically at the end of backward; calling it again is a no-op. After a backward
        that raised part way it launches the remaining buckets (zeros for missing gradients) and
        completes the round, so every rank must call it at the same point. Under compiled autograd,
        where no end-of-backward callback runs, call it after every backward.
        """
        with self._lock:
            if self._join_notified:  # the backward's Join bookkeeping, when no callback ended it
                self._end_join_iteration()
                self._callback_tasks.clear()
            self._finish_round()

    def remove(self) -> None:
        """Completes a pending round, then detaches every hook: training is local afterwards."""
        if self._removed:
            return
        try:
            self.synchronize()
        finally:
            self._detach()

    def __enter__(self) -> GradientAverager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.remove()
        else:  # do not start collectives other ranks may never join; just wait for launched ones
            self._abandon_round()
            self._detach()

    def __repr__(self) -> str:
        return (
            f"<ringreduce.GradientAverager {len(self._params)} params in {len(self._buckets)} buckets "
            f"{self.bucket_sizes} view={self.gradient_as_bucket_view}>"
        )

    # ------------------------------------------------------------------------------------ hooks

    def _make_pre_hook(self, i: int) -> Any:
        def pre_hook(grad: torch.Tensor) -> None:
            # Runs before the gradient is accumulated into .grad: refuse while our bucket is in flight
            # (accumulating now would race with the ring or be overwritten by the average).
            if self._round and self._buckets[self._bucket_of[i]].launched:
                raise RuntimeError(
                    f"ringreduce.GradientAverager: parameter #{i} (shape {tuple(self._params[i].shape)}) got a "
                    "gradient while its bucket from an earlier backward is still being averaged: a second "
                    "backward started before the first was synchronized. Let the first backward finish (or "
                    "call synchronize() after a backward that raised) before starting another; a parameter "
                    "that gets gradients in two graph tasks of one backward (used both inside and outside a "
                    "reentrant checkpoint) is not supported"
                )

        return pre_hook

    def _make_post_hook(self, i: int) -> Any:
        def post_hook(param: torch.Tensor) -> None:
            with self._lock:
                self._on_grad_ready(i, param)

        return post_hook

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if self._removed:
            return
        if self._join_config.enable and not self._join_notified:
            self._notify_join()
        grad = param.grad
        if grad is not None and grad.layout != torch.strided:
            raise RuntimeError(
                f"ringreduce.GradientAverager: parameter #{i} got a {grad.layout} gradient; only dense "
                "gradients are supported (e.g. nn.Embedding(sparse=False))"
            )
        local = local_tensor(grad)
        if local is not grad:
            self._check_dtensor_grad(i, grad, local)
        if self.gradient_as_bucket_view and grad is not None and not _is_view_of(local, self._slots[i]):
            self._slots[i].copy_(local)
            param.grad = _as_grad(self._slots[i], param, grad)
        self._used[i] = True
        if not self._sync:
            # accumulation_steps: this backward is counted when it ends (Note [End of backward]).
            self._nosync_pending = True
            self._queue_end_callback()
            return
        if not self._round:
            self._start_round()
        self._queue_end_callback()
        if self._ready[i]:
            return  # accumulated again before its bucket went out: the launch copies the total
        self._ready[i] = True
        bucket = self._buckets[self._bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order(upto=len(self._buckets), force=False)

    def _check_dtensor_grad(self, i: int, grad: Any, local: torch.Tensor) -> None:
        """Refuses DTensor gradients whose local shard cannot be averaged as is (Note [DTensor gradients])."""
        if local.shape != self._slots[i].shape:
            raise RuntimeError(
                f"ringreduce.GradientAverager: parameter #{i} got a DTensor gradient whose local shard has shape "
                f"{tuple(local.shape)}, but the parameter's local shard has shape {tuple(self._slots[i].shape)} "
                f"(gradient placements {tuple(grad.placements)}); give the gradient the parameter's placements"
            )
        mesh = grad.device_mesh
        for dim, placement in enumerate(grad.placements):
            if not placement.is_partial():
                continue
            key = (id(mesh), dim)
            if key not in self._partial_dims:
                if self._averaged_ranks is None:
                    self._averaged_ranks = _global_ranks(self.group)
                peers = dist.get_process_group_ranks(mesh.get_group(dim))
                self._partial_dims[key] = len(self._averaged_ranks.intersection(peers)) > 1
            if self._partial_dims[key]:
                names = mesh.mesh_dim_names
                raise RuntimeError(
                    f"ringreduce.GradientAverager: parameter #{i} got a DTensor gradient with placement {placement} "
                    f"on mesh dimension {names[dim] if names else dim}, which this averager averages over; a "
                    "Partial gradient is a pending sum over those ranks and averaging its local shards would mix "
                    "the two reductions. Redistribute it (e.g. to Replicate) before it reaches .grad, or average "
                    "over the other mesh dimensions only (mesh=...)"
                )

    def _start_round(self) -> None:
        accumulated, self._accumulated = self._accumulated + 1, 0
        if self.accumulation_steps > 1 and not _compiled_autograd_active() and accumulated != self.accumulation_steps:
            self._refuse_round(accumulated)
        self._round_divisor = 0
        if self._join_flag is not None and not self._join_divide_by_initial and self.op == ReduceOp.AVG:
            self._join_works[-1].wait()
            active = int(self._join_flag.item())
            if 0 < active < self._world_size():
                self._round_divisor = active
        self._round = True
        self._next = 0
        self._ready = [False] * len(self._params)
        for b in self._buckets:
            b.pending = len(b.params)
            b.launched = False
            b.work = None

    def _refuse_round(self, accumulated: int) -> None:
        """A synced backward after the wrong number of no_sync() backwards: every bucket of the round is
        refused (the other ranks' calls for them raise at once, Note [Cross-rank agreement]), then
        RuntimeError."""
        message = (
            f"ringreduce.GradientAverager: accumulation_steps={self.accumulation_steps}, but this synced backward "
            f"follows {accumulated - 1} backwards inside no_sync() (expected {self.accumulation_steps - 1}), so "
            f"dividing the accumulated gradients by {self.accumulation_steps} would be wrong. Run "
            f"{self.accumulation_steps - 1} backwards inside no_sync() before each synced one (or change "
            "accumulation_steps); no gradient was reduced"
        )
        for b in self._buckets:
            assert b.buffer is not None
            with contextlib.suppress(RuntimeError):
                refuse_call(self.group, b.buffer, CallKind.ALL_REDUCE, RuntimeError(message))
        raise RuntimeError(message)

    def _queue_end_callback(self) -> None:
        if _compiled_autograd_active():
            # Compiled autograd supports engine callbacks only in fullgraph mode, which these hooks
            # (a lock, native calls) are not: the caller finishes the round with synchronize().
            return
        task = torch._C._current_graph_task_id()
        if task in self._callback_tasks:
            return
        self._callback_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        outer = torch._C._current_autograd_node()
        if outer is not None:
            # A nested (reentrant) backward ended inside the outer node `outer`: finish the round at
            # the end of the outer backward instead. See Note [End of backward].
            holder: list[Any] = []

            def after_outer_node(*_: Any) -> None:
                holder[0].remove()
                with self._lock:
                    if self._round or self._join_notified or self._nosync_pending:
                        self._queue_end_callback()

            holder.append(outer.register_hook(after_outer_node))
            return
        with self._lock:
            if self._nosync_pending:  # a backward inside no_sync() ended: count it
                self._nosync_pending = False
                self._accumulated += 1
                if not self._round:
                    self._callback_tasks.clear()
            if self._join_notified:
                self._end_join_iteration()
                if not self._round:
                    self._callback_tasks.clear()
            self._finish_round()

    # --------------------------------------------------------------------------------- launching

    def _launch_in_order(self, upto: int, force: bool) -> None:
        while self._next < upto:
            bucket = self._buckets[self._next]
            if bucket.pending > 0 and not force:
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        assert bucket.buffer is not None
        with torch.no_grad():
            for i in bucket.params:
                p, slot = self._params[i], self._slots[i]
                grad = p.grad
                if grad is None:
                    slot.zero_()  # unused here: contribute zeros (the slot may hold an old value)
                elif not _is_view_of(local_tensor(grad), slot):
                    slot.copy_(local_tensor(grad))
                    if self.gradient_as_bucket_view:
                        p.grad = _as_grad(slot, p, grad)
            if bucket.flags:
                flags = torch.tensor(self._used, dtype=torch.float32).to(bucket.dtype)
                bucket.buffer[bucket.numel :].copy_(flags)
        op = ReduceOp.SUM if self._round_divisor else self.op  # Note [Uneven inputs]
        work = self._reduce(bucket.buffer, op)
        assert work is not None
        bucket.work = work
        bucket.launched = True

    # ---------------------------------------------------------------------------------- finishing

    def _reduce(self, buffer: torch.Tensor, op: ReduceOp) -> Work | None:
        """The asynchronous all-reduce of one bucket `buffer` with `op` and the averager's options (a
        shadowing rank's zeros take the same call: Note [Uneven inputs])."""
        accum = self.accum_dtype if buffer.dtype in _HALF_TYPES else None
        wire = self.wire_dtype if buffer.dtype == torch.float32 else None
        return run_all_reduce(buffer, op, self.group, True, accum, "auto", CallKind.ALL_REDUCE, wire_dtype=wire,
                              predivide_factor=self.predivide_factor, extra_divisor=self.accumulation_steps)

    def _finish_round(self) -> None:
        if not self._round:
            return
        try:
            self._launch_in_order(upto=len(self._buckets), force=True)
            all_used_here = all(self._used)
            if all_used_here:
                # Every parameter is used somewhere: copy each bucket back as soon as it is done.
                for b in self._buckets:
                    self._wait(b)
                    self._copy_back(b, None)
            else:
                for b in self._buckets:
                    self._wait(b)
                last = self._buckets[-1]
                assert last.buffer is not None
                used = (last.buffer[last.numel :] != 0).tolist()
                for b in self._buckets:
                    self._copy_back(b, used)
        except BaseException:
            self._abandon_round()
            raise
        self._end_round()

    def _wait(self, bucket: _Bucket) -> None:
        assert bucket.work is not None
        bucket.work.wait()

    def _copy_back(self, bucket: _Bucket, used: list[bool] | None) -> None:
        with torch.no_grad():
            if self._round_divisor:
                assert bucket.buffer is not None
                bucket.buffer[: bucket.numel].div_(self._round_divisor)
            for i in bucket.params:
                if used is not None and not used[i]:
                    continue  # no rank used it: leave .grad as it was (None stays None)
                p, slot = self._params[i], self._slots[i]
                if self.gradient_as_bucket_view:
                    if p.grad is None or not _is_view_of(local_tensor(p.grad), slot):
                        p.grad = _as_grad(slot, p, p.grad)
                elif p.grad is None:
                    p.grad = _as_grad(slot.clone(), p, None)
                else:
                    local_tensor(p.grad).copy_(slot)  # in place: a DTensor keeps its placements

    def _end_round(self) -> None:
        self._round = False
        self._round_divisor = 0
        self._next = 0
        self._used = [False] * len(self._params)
        self._callback_tasks.clear()
        for b in self._buckets:
            b.work = None
            b.launched = False

    def _abandon_round(self) -> None:
        """Forgets the current round after an error, waiting (errors ignored) for launched buckets."""
        for b in self._buckets:
            if b.work is not None:
                with contextlib.suppress(Exception):
                    b.work.wait()
        self._end_round()

    def _detach(self) -> None:
        self._removed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # --------------------------------------------------------------------------- uneven inputs

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``torch.distributed.algorithms.Join`` runs on a rank that ran out of inputs.

        `kwargs`: the keyword arguments given to ``Join(...)``; this hook reads
        ``divide_by_initial_world_size`` (default True:
        the sum is divided by the group's size whatever the number of ranks still training, so
        every input weighs the same; False: by the number of ranks still training). See Note
        [Uneven inputs]. Raises TypeError when it is not a bool.
        """
        divide = kwargs.get("divide_by_initial_world_size", True)
        if not isinstance(divide, bool):
            raise TypeError(f"divide_by_initial_world_size must be a bool, got {type(divide).__name__}")
        self._join_divide_by_initial = divide
        return _AveragerJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where the Join context's flags live: the device of the first parameter (CPU without any)."""
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """The process group the averager averages over (the Join context's collectives run on it).

        Raises ValueError for a multi-dimensional DeviceMesh (no process group spans it: use Join
        with a ProcessGroup or a 1-D mesh) and on a rank outside the group.
        """
        info = resolve(self.group)
        if info is None:
            raise ValueError("ringreduce.GradientAverager: this rank is not a member of the averager's group; Join needs one")
        if info.members:
            raise ValueError(
                f"ringreduce.GradientAverager: Join needs a process group; {info.name} is a flattened DeviceMesh. "
                "Average over a ProcessGroup or a 1-D mesh to train with uneven inputs"
            )
        if info.global_ranks:  # a "ringreduce" group's ring runs over an inner group torch does not know
            return self.group.get_group() if _is_device_mesh(self.group) else (self.group or dist.group.WORLD)
        return info.pg

    def _world_size(self) -> int:
        info = resolve(self.group)
        return info.size if info is not None else 1

    def _notify_join(self) -> None:
        """An active rank's first hook of a backward under Join: the all-reduces a joined rank's
        main hook shadows (Note [Uneven inputs]). May raise RuntimeError (throw_on_early_termination)."""
        work = Join.notify_join_context(self)  # the count of active ranks (+ the early-termination check)
        self._join_notified = True
        self._queue_end_callback()
        if work is not None:
            self._join_works.append(work)
        flag = torch.ones(1, device=self.join_device) if self._sync else torch.zeros(1, device=self.join_device)
        self._join_works.append(dist.all_reduce(flag, group=self.join_process_group, async_op=True))
        self._join_flag = flag

    def _end_join_iteration(self) -> None:
        works, self._join_works = self._join_works, []
        for w in works:
            w.wait()
        self._join_notified = False
        self._join_flag = None

    def _shadow_round(self, syncing: int) -> None:
        """A joined rank's part of one synced backward of the others: every bucket, zeros."""
        divisor = 0 if self._join_divide_by_initial or syncing >= self._world_size() else syncing
        works = []
        for b in self._buckets:
            assert b.buffer is not None
            zeros = torch.zeros_like(b.buffer)
            works.append(self._reduce(zeros, ReduceOp.SUM if divisor else self.op))
        for w in works:
            assert w is not None
            w.wait()

    def _broadcast_parameters(self, src: int) -> None:
        """Every rank takes the parameters of group rank `src` (one broadcast per bucket)."""
        pg = self.join_process_group
        with torch.no_grad():
            for b in self._buckets:
                flat = torch.cat([self._locals[i].detach().reshape(-1) for i in b.params])
                dist.broadcast(flat, group=pg, group_src=src)
                for i, off in zip(b.params, b.offsets, strict=True):
                    local = self._locals[i]
                    local.copy_(flat[off : off + local.numel()].view(local.shape))


class _AveragerJoinHook(JoinHook):
    """What a rank that ran out of inputs runs under Join (Note [Uneven inputs])."""

    def __init__(self, averager: GradientAverager) -> None:
        self.averager = averager

    def main_hook(self) -> None:
        avg = self.averager
        flag = torch.zeros(1, device=avg.join_device)
        dist.all_reduce(flag, group=avg.join_process_group)  # the active ranks' sync flags
        syncing = int(flag.item())
        if syncing > 0:
            avg._shadow_round(syncing)

    def post_hook(self, is_last_joiner: bool) -> None:
        avg = self.averager
        pg = avg.join_process_group
        candidate = torch.tensor([dist.get_rank(pg) if is_last_joiner else -1], device=avg.join_device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=pg)
        avg._broadcast_parameters(int(candidate.item()))
        avg._join_config = _JoinConfig.construct_disabled_join_config()  # the Join context is over


class CommHookState:
    """What ringreduce.ddp_comm_hook does with each bucket:
    ``ddp.register_comm_hook(rr.CommHookState(...), rr.ddp_comm_hook)``.

    `op`: "avg" (DDP's average, the default) or "sum" (DataParallel's sum); `wire_dtype`:
    torch.bfloat16 or torch.float16 carries float32 buckets as 16-bit partials with float32 sums per
    hop (ringreduce.all_reduce's ``wire_dtype``; buckets of other dtypes are reduced as they are);
    `predivide_factor`: ringreduce.all_reduce's (divide by f before the ring, scale once after; the
    result is the same); `process_group`: the group DDP was built with (None: the default group).
    Invalid values raise ValueError/TypeError here.
    """

    def __init__(self, wire_dtype: torch.dtype | None = None, op: str = "avg", predivide_factor: float | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        """Validates and keeps `wire_dtype`, `op`, `predivide_factor` and `process_group` (see the class)."""
        self.op = _check_op(op, "CommHookState")
        _check_scaling(wire_dtype, predivide_factor, "CommHookState")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"ringreduce.CommHookState: process_group must be a ProcessGroup or None, got {type(process_group).__name__}"
            )
        self.wire_dtype = wire_dtype
        self.predivide_factor = predivide_factor
        self.process_group = process_group

    def __repr__(self) -> str:
        return (f"CommHookState(wire_dtype={self.wire_dtype}, op={self.op.name.lower()!r}, "
                f"predivide_factor={self.predivide_factor}, process_group={self.process_group})")


def ddp_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook that averages (or sums) each gradient bucket with ringreduce's ring.

    Register it with ``ddp.register_comm_hook(state, ringreduce.ddp_comm_hook)`` where `state` is
    None (the default group), a ``ProcessGroup``, a ringreduce.CommHookState (op, wire_dtype,
    predivide_factor, process_group), or another object with a ``process_group`` attribute (use the
    group DDP was built with). `bucket` is DDP's GradBucket: its buffer is reduced in place
    asynchronously (AVG: sum, then one division by the world size: no fp16 pre-division unless a
    predivide_factor asks for it) and the returned Future's value is the bucket tensor itself, as
    DDP requires. On CPU the Future is completed by ringreduce's worker thread; on GPUs the
    reduction runs on ringreduce's streams.
    """
    options = state if isinstance(state, CommHookState) else None
    group = state
    if options is not None:
        group = options.process_group
    elif state is not None and not isinstance(state, dist.ProcessGroup):
        group = getattr(state, "process_group", _NO_GROUP)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "ringreduce.ddp_comm_hook: state must be None, a torch.distributed.ProcessGroup, a "
            f"ringreduce.CommHookState or an object with a process_group attribute, got {type(state).__name__}"
        )
    buffer = bucket.buffer()
    if options is None:
        work = all_reduce(buffer, op=ReduceOp.AVG, group=group, async_op=True)
    else:
        wire = options.wire_dtype if buffer.dtype == torch.float32 else None
        work = all_reduce(buffer, op=options.op, group=group, async_op=True, wire_dtype=wire,
                          predivide_factor=options.predivide_factor)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP's register_comm_hook compares the annotations as objects; this module's postponed (string)
# annotations would be rejected ("bucket annotation should be dist.GradBucket").
ddp_comm_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
