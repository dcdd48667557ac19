"""GradientAverager: gradients bucketed (buckets.py) and averaged with ringreduce's ring while backward
still runs, its no_sync/accumulation, Join and DTensor support.

Note [End of backward]
    The first hook of a synced backward queues an autograd engine callback that launches the buckets
    that never became ready, waits for every bucket and writes the averages back. A callback that runs
    while a node still executes (``torch._C._current_autograd_node()``: the inner backward of reentrant
    checkpointing) puts a post-hook on that node instead, which queues it again on the outer graph task
    (docs/hooks.md section 2, "How it works").

Note [Unused parameters]
    The used flags (gradient accumulated since the last synced backward, no_sync steps included) ride
    as extra elements of the last bucket: their AVG is non-zero iff some rank used the parameter, with
    no extra round trip. The last bucket goes out after all earlier ones, when every hook fired or at
    the end of backward, so its flags are final (docs/hooks.md section 2, "Unused parameters").

Note [Uneven inputs]
    The Join protocol as DDP follows it, one backward per iteration. An active rank's first hook of a
    backward calls ``Join.notify_join_context`` (an all-reduce of 1, plus the early-termination one)
    and all-reduces its sync flag (1 unless in ``no_sync``). A joined rank, in ``Join.__exit__``,
    all-reduces 0 against both and, if any rank syncs, one all-reduce of zeros per bucket in bucket
    order with the same sizes, dtypes, op and options, so the agreement frames match. The sum is
    divided by the group's size (AVG, ``divide_by_initial_world_size=True``) or, with False, summed
    and divided by the syncing ranks (the flags' sum). Once every rank joined, post_hook agrees on a
    last joiner (an all-reduce MAX) and broadcasts its parameters to every rank, as DDP does.

Note [DTensor gradients]
    A DTensor parameter is bucketed by its local shard; its gradient's local shard is copied in and the
    average written back in place, so the gradient keeps its placements (one the averager creates gets
    the parameter's). A Partial placement on an averaged mesh dimension would mix two reductions and
    raises RuntimeError (docs/hooks.md section 4).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from ringreduce._call import local_tensor, predivide_refusal, refuse, run_all_reduce
from ringreduce._groups import _is_device_mesh, resolve
from ringreduce._options import AllreduceOptions, avg_or_sum
from ringreduce._param_check import check_model
from ringreduce._types import CallKind, FrameError
from ringreduce.hooks.buckets import (
    _as_grad,
    _assign_buckets,
    _Bucket,
    _collect_params,
    _compiled_autograd_active,
    _global_ranks,
    _is_view_of,
    _slot_view,
)
from ringreduce.ops import ReduceOp
from ringreduce.work import Work

_MB = 1024 * 1024


class GradientAverager(Joinable):
    """Averages gradients across the ranks of `group` while backward runs (ringreduce's ring).

    Registers a post-accumulate-grad hook on every parameter of `module_or_params` that requires
    grad (an ``nn.Module`` or an iterable of parameters; tied parameters count once). Gradients are
    packed into flat per-dtype, per-device buckets, ``first_bucket_mb`` for the first and
    ``bucket_cap_mb`` for the others, each averaged asynchronously as soon as it and every bucket
    before it are complete; when backward returns (activation checkpointing, reentrant or not, is
    handled) ``.grad`` holds the average over ranks (on GPUs the caller's stream is ordered after the
    reductions): docs/hooks.md section 2. Every rank must run the same sequence of synced backwards,
    each reaching at least one of the parameters.

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

    Construction is collective: one all-reduce checks that every rank has the same parameters, else
    each raises ValueError naming the first difference (Note [Same parameters on every rank]); a DDP
    module warns (its gradients would be averaged twice).

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
        self.op = avg_or_sum(op, "ringreduce.GradientAverager")
        # the buckets' options: with the averager's op, and with SUM (Note [Uneven inputs])
        self._options = {o: AllreduceOptions(o, accum_dtype, "auto", wire_dtype, predivide_factor,
                                             extra_divisor=accumulation_steps)
                         for o in (self.op, ReduceOp.SUM)}
        self._options[self.op].check("ringreduce.GradientAverager")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(
                f"ringreduce.GradientAverager: accumulation_steps must be an int >= 1, got {accumulation_steps!r}"
            )
        info = resolve(group)  # a clear error now if torch.distributed is not initialized
        self.group = group
        self.accum_dtype = accum_dtype
        self.predivide_factor = predivide_factor
        self.wire_dtype = wire_dtype
        self.accumulation_steps = accumulation_steps
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self._params = _collect_params(module_or_params)
        # What is bucketed: the tensors themselves, or a DTensor's local shard (Note [DTensor gradients]).
        self._locals = [local_tensor(p) for p in self._params]
        check_model(module_or_params, self._params, self._locals, group)  # Note [Same parameters on every rank]
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
            self._buckets.append(_Bucket(dtype, device, members, offsets, numel))
        if wire_dtype is not None and not any(b.dtype == torch.float32 for b in self._buckets):
            raise ValueError(
                f"ringreduce.GradientAverager: wire_dtype={wire_dtype} applies to float32 gradients, and this "
                f"model has none (dtypes {sorted({str(b.dtype) for b in self._buckets})}); drop wire_dtype"
            )
        if predivide_factor is not None and info is not None:  # a factor no bucket's sum could take
            for dtype in dict.fromkeys(b.dtype for b in self._buckets if b.dtype.is_floating_point or b.dtype.is_complex):
                error = predivide_refusal(float(predivide_factor), dtype, self.op, info.size, accumulation_steps)
                if error is not None:
                    raise ValueError(f"{error} (ringreduce.GradientAverager)")
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
            self._launch_in_order(force=False)

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
        """Refuses every bucket of a synced backward after the wrong number of no_sync() backwards (the
        others' calls raise at once, Note [Cross-rank agreement]), then raises RuntimeError."""
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
                refuse(resolve(self.group), CallKind.ALL_REDUCE, FrameError.OTHER, RuntimeError(message),
                       b.buffer.device)
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
            if self._join_notified:
                self._end_join_iteration()
            if not self._round:
                self._callback_tasks.clear()
            self._finish_round()

    # --------------------------------------------------------------------------------- launching

    def _launch_in_order(self, force: bool) -> None:
        while self._next < len(self._buckets):
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
        options = self._options[op].for_buffer(buffer.dtype)
        return run_all_reduce(buffer, self.group, options, True, CallKind.ALL_REDUCE)

    def _finish_round(self) -> None:
        if not self._round:
            return
        try:
            self._launch_in_order(force=True)
            all_used_here = all(self._used)
            if all_used_here:
                # Every parameter is used somewhere: copy each bucket back as soon as it is done.
                for b in self._buckets:
                    b.work.wait()
                    self._copy_back(b, None)
            else:
                for b in self._buckets:
                    b.work.wait()
                last = self._buckets[-1]
                assert last.buffer is not None
                used = (last.buffer[last.numel :] != 0).tolist()
                for b in self._buckets:
                    self._copy_back(b, used)
        except BaseException:
            self._abandon_round()
            raise
        self._end_round()

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
        outer = self.group.get_group() if _is_device_mesh(self.group) else (self.group or dist.group.WORLD)
        return outer if info.global_ranks else info.pg  # a "ringreduce" group's ring: an inner group torch lacks

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
