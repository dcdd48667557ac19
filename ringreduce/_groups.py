"""Process-group resolution shared by every collective: process groups, DeviceMesh, node layout."""

from __future__ import annotations

import collections
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ringreduce import _config
from ringreduce._config import Knobs


class NotInitializedError(RuntimeError, ValueError):
    """torch.distributed is not initialized: a RuntimeError, as ringreduce raised it before, and a
    ValueError, as torch.distributed raises it (its message comes first)."""


@dataclass(frozen=True)
class GroupInfo:
    pg: dist.ProcessGroup  # the group whose transport (gloo send/recv, NCCL communicator) carries the ring
    rank: int  # this process's index in the ring
    size: int  # ranks in the ring
    name: str  # for messages
    # The ring's ranks as ranks of `pg`, in ring order; () = every rank of pg in rank order. A
    # DeviceMesh sub-mesh is a ring over a rank list of WORLD (Note [Sub-rings by rank list] in
    # csrc/core/transport.h): no process group is created for it.
    members: tuple[int, ...] = ()
    # The global rank of each rank of `pg`; () = ask torch.distributed. Set for the inner group of a
    # "ringreduce" backend group (ringreduce/distributed/), which torch's tables do not know.
    global_ranks: tuple[int, ...] = ()
    # The node of each rank of `pg` when the group's creator knows better than the launcher; () = from
    # the launcher (_node_of_global_ranks). A torchft group (ringreduce/torchft.py) spans replica groups,
    # each its own torchrun, whose GROUP_RANK says nothing about the others: all zeros there (the flat
    # ring, in shared memory where the ranks' hosts match, Note [Shared-memory segments]).
    nodes: tuple[int, ...] = ()

    @property
    def store(self) -> Any:
        """The c10d store of `pg`, where the ring's ranks agree on shared memory (looked up once)."""
        hit = _stores.get(id(self.pg))
        if hit is None or hit[0] is not self.pg:
            hit = (self.pg, dist.distributed_c10d._get_process_group_store(self.pg))
            _stores[id(self.pg)] = hit
        return hit[1]


_warned_non_member: set[int] = set()


def _warn_non_member(key: int) -> None:
    if key in _warned_non_member:
        return
    _warned_non_member.add(key)
    warnings.warn(
        "ringreduce: this rank is not a member of the given group; the call returns at once "
        "and leaves the tensor unchanged (as torch.distributed does)",
        stacklevel=4,
    )


def _is_device_mesh(obj: Any) -> bool:
    # No DeviceMesh can exist before its module is imported: plain groups cost one lookup.
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    return mesh_type is not None and isinstance(obj, mesh_type)


def _resolve_mesh(mesh: Any) -> GroupInfo | None:
    """A DeviceMesh: 1-D uses the dimension's own group; an n-D (sub-)mesh is flattened into one ring
    over this rank's slice (row-major order), a rank list of WORLD."""
    dims = getattr(mesh, "mesh_dim_names", None)
    label = f"DeviceMesh{tuple(dims) if dims else ''}"
    if mesh.ndim == 1:
        pg = mesh.get_group()
        info = _resolve_pg(pg)
        if info is None:
            return None
        return GroupInfo(pg=info.pg, rank=info.rank, size=info.size, name=f"{label} ({info.name})")
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    world = dist.group.WORLD
    me = dist.get_rank()
    if me not in ranks:
        _warn_non_member(hash(tuple(ranks)))
        return None
    members = tuple(dist.get_group_rank(world, r) for r in ranks)
    ring = _backend_ring(world)  # WORLD of backend "ringreduce": the ring runs over its inner group
    return GroupInfo(
        pg=world if ring is None else ring.pg, rank=ranks.index(me), size=len(ranks),
        name=f"{label} ranks {ranks} (flattened)", members=members,
        global_ranks=() if ring is None else ring.global_ranks,
    )


def _backend_ring(pg: Any) -> GroupInfo | None:
    """The ring of a process group created with backend "ringreduce" (its inner group, whose transport
    carries the ring, ringreduce/distributed/), or None for any other group."""
    ring = getattr(pg, "_ringreduce_ring", None)
    return ring if isinstance(ring, GroupInfo) else None


def _resolve_pg(pg: dist.ProcessGroup) -> GroupInfo | None:
    rank = dist.get_rank(pg)
    if rank < 0:
        _warn_non_member(id(pg))
        return None
    ring = _backend_ring(pg)
    if ring is not None:
        return ring
    size = dist.get_world_size(pg)
    if pg is dist.group.WORLD:
        name = f"WORLD (size {size})"
    else:
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # noqa: BLE001 - naming only
            ranks = []
        pgname = getattr(pg, "group_name", "") or ""
        name = f"group {pgname!r} ranks {ranks}" if ranks else f"group {pgname!r} (size {size})"
    return GroupInfo(pg=pg, rank=rank, size=size, name=name)


def resolve(group: Any) -> GroupInfo | None:
    """The ring's info for `group` (None: WORLD, a ProcessGroup, a DeviceMesh, flattened when n-D, or a
    GroupInfo, returned as is), or None on a rank outside it. A "ringreduce" group resolves to the ring
    over its inner group. RuntimeError when torch.distributed is not initialized, TypeError otherwise.
    """
    if isinstance(group, GroupInfo):
        return group
    if not dist.is_available():
        raise RuntimeError("ringreduce needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise NotInitializedError(
            "Default process group has not been initialized, please make sure to call init_process_group. "
            "(ringreduce: the default process group is not initialized; call "
            "torch.distributed.init_process_group(backend=...) first, e.g. under torchrun)"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns to outsiders
        _warn_non_member(-1)
        return None
    if _is_device_mesh(group):
        return _resolve_mesh(group)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "ringreduce: group must be a torch.distributed.ProcessGroup, a DeviceMesh or None, got "
            f"{type(group).__name__}"
        )
    pg = group if group is not None else dist.group.WORLD
    # A group's rank, size and ranks never change: its GroupInfo is kept, with the group itself so
    # that its id cannot be reused while cached (one dict lookup instead of a dozen dist queries).
    hit = _resolved.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    info = _resolve_pg(pg)
    if info is not None:
        with _resolved_lock:
            _resolved[id(pg)] = (pg, info)
    return info


_resolved_lock = threading.Lock()
_resolved: dict[int, tuple[Any, GroupInfo]] = {}
_stores: dict[int, tuple[Any, Any]] = {}


def set_store(pg: Any, store: Any) -> None:
    """Records the store of a process group that torch's tables do not know (a backend's inner group)."""
    with _resolved_lock:
        _stores[id(pg)] = (pg, store)


def forget_ring(ring: GroupInfo | None = None) -> None:
    """Drops every cached entry that refers to `ring`'s process group (being destroyed); with None,
    every cached GroupInfo and its process group (at interpreter exit, see __init__)."""
    pg = None if ring is None else ring.pg
    with _resolved_lock:
        for key, (_, info) in list(_resolved.items()):
            if pg is None or info.pg is pg:
                del _resolved[key]
        for key, (held, _) in list(_stores.items()):
            if pg is None or held is pg:
                del _stores[key]
    with _layout_lock:
        for key in [k for k in _layouts if pg is None or k[0] == id(pg)]:
            del _layouts[key]


# ---------------------------------------------------------------------------------------------
# Node layout for the hierarchical all-reduce


@dataclass(frozen=True)
class NodeLayout:
    members: tuple[int, ...]  # ranks of the ring's pg, node by node (node k: members[k*L:(k+1)*L])
    local_size: int  # L: ranks of the ring per node; 0: the nodes hold different numbers of them
    nodes: int  # M
    node_of_member: tuple[int, ...]  # node id of each ring member, in the ring's own order


_layout_lock = threading.Lock()
_layouts: dict[tuple[Any, ...], NodeLayout] = {}
_NODE_KEY = "ringreduce/node_of_rank/{rank}"


def _node_of_global_ranks(global_ranks: list[int], knobs: Knobs) -> list[int]:
    """Node id of each global rank, from the launcher (GROUP_RANK, LOCAL_WORLD_SIZE) or the override,
    as the ring's `knobs` read them.

    Not from hostnames: simulated nodes share one host. Every rank publishes its GROUP_RANK in the
    default store and reads the ring's (one multi_get) rather than deriving it from rank numbering,
    so that all ranks agree on the layout whatever the launcher's numbering.
    """
    if knobs.local_size is not None:
        return [g // knobs.local_size for g in global_ranks]
    group_rank, local_world, world = knobs.launcher
    if group_rank is None or local_world is None:
        return [0 for _ in global_ranks]  # no launcher information: one node
    if world is not None and int(world) == int(local_world):
        return [0 for _ in global_ranks]  # the launcher put every rank on one node
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    if _published_node.get(me) != group_rank:
        store.set(_NODE_KEY.format(rank=me), group_rank)
        _published_node[me] = group_rank
    values = store.multi_get([_NODE_KEY.format(rank=g) for g in global_ranks])
    return [int(v.decode() if isinstance(v, bytes) else v) for v in values]


_published_node: dict[int, str] = {}


def node_layout(info: GroupInfo, knobs: Knobs | None = None) -> NodeLayout:
    """How the ring's ranks spread over nodes, as its `knobs` read the layout (default: the environment
    now; cached per group, rank list and layout)."""
    knobs = knobs if knobs is not None else _config.read()
    key = (id(info.pg), info.members, knobs.local_size, knobs.launcher)
    with _layout_lock:
        cached = _layouts.get(key)
    if cached is not None:
        return cached
    ring = info.members or tuple(range(info.size))
    if info.global_ranks:
        global_ranks = [info.global_ranks[r] for r in ring]
    elif info.pg is dist.group.WORLD:
        global_ranks = list(ring)
    else:
        global_ranks = [dist.get_global_rank(info.pg, r) for r in ring]
    nodes = [info.nodes[r] for r in ring] if info.nodes else _node_of_global_ranks(global_ranks, knobs)
    order = sorted(range(len(ring)), key=lambda i: (nodes[i], global_ranks[i]))
    counts = collections.Counter(nodes)
    sizes = set(counts.values())
    layout = NodeLayout(
        members=tuple(ring[i] for i in order),
        local_size=sizes.pop() if len(sizes) == 1 else 0,
        nodes=len(counts),
        node_of_member=tuple(nodes),
    )
    with _layout_lock:
        _layouts[key] = layout
    return layout


def choose_algorithm(info: GroupInfo, algorithm: str, knobs: Knobs | None = None) -> tuple[int, tuple[int, ...]]:
    """(local_size, members) of an all-reduce: 0 and info.members for a flat one (the ring, or the
    direct all-reduce: "direct" is always flat); L > 0 for the hierarchical all-reduce over `members`
    ordered node by node, L ranks per node (the layout as the ring's `knobs` read it, node_layout).
    "auto" picks it for several equal nodes of more than one rank; "hierarchical" is the flat ring on
    one node or one rank per node, ValueError on unequal nodes.
    """
    if algorithm in ("ring", "direct") or info.size <= 2:
        return 0, info.members
    layout = node_layout(info, knobs)
    if algorithm == "hierarchical" and not layout.local_size:
        raise ValueError(
            f"ringreduce: algorithm='hierarchical' needs the same number of ranks of {info.name} on every "
            f"node, got node ids {list(layout.node_of_member)} (from GROUP_RANK/LOCAL_WORLD_SIZE or "
            "RINGREDUCE_LOCAL_SIZE); use algorithm='ring' or 'auto'"
        )
    if layout.nodes > 1 and layout.local_size > 1:
        return layout.local_size, layout.members
    return 0, info.members


def one_node(info: GroupInfo, knobs: Knobs | None = None) -> bool:
    """Whether every rank of the ring is on one node, as the launcher (or RINGREDUCE_LOCAL_SIZE) says:
    the rings that may use shared memory (the same answer on every rank)."""
    return node_layout(info, knobs).nodes == 1
