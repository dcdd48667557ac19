"""Process-group resolution shared by every collective."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class GroupInfo:
    pg: dist.ProcessGroup
    rank: int  # rank inside the group
    size: int
    name: str  # for messages


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


def resolve(group: dist.ProcessGroup | None) -> GroupInfo | None:
    """Returns the group's info, or None when this process is not a member of `group`.

    Raises RuntimeError (with what to do) when torch.distributed is not initialized.
    """
    if not dist.is_available():
        raise RuntimeError("ringreduce needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "ringreduce: the default process group is not initialized; call "
            "torch.distributed.init_process_group(backend=...) first (e.g. under torchrun)"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns to outsiders
        _warn_non_member(-1)
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"ringreduce: group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    if rank < 0:
        _warn_non_member(id(pg))
        return None
    size = dist.get_world_size(pg)
    if group is None or pg is dist.group.WORLD:
        name = f"WORLD (size {size})"
    else:
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # noqa: BLE001 - naming only
            ranks = []
        pgname = getattr(pg, "group_name", "") or ""
        name = f"group {pgname!r} ranks {ranks}" if ranks else f"group {pgname!r} (size {size})"
    return GroupInfo(pg=pg, rank=rank, size=size, name=name)
