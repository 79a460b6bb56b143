"""How a Communicator learns its rank, world size and 16-byte id (Communicator's docstring gives the order)."""

from __future__ import annotations

import ctypes
import os
import threading

from . import _capi
from ._capi import lib
from ._memory import check

# Communicators made from one torch.distributed group so far, by group name: the store key of the next one's id.
_store_counters: dict[str, int] = {}
_store_lock = threading.Lock()


def parse_id(text: str) -> bytes:
    t = text.strip().lower()
    if t.startswith("0x"):
        t = t[2:]
    try:
        raw = bytes.fromhex(t)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"tandem: TANDEM_ID must be 32 hex digits (from `tandemctl new-id` or tandem.new_id()), got "
                         f"{text!r}")
    return raw


def new_id() -> str:
    """A fresh communicator id (tandem_get_unique_id) as 32 hex digits, for TANDEM_ID."""
    uid = _capi.UniqueId()
    check(lib.tandem_get_unique_id(ctypes.byref(uid)))
    return bytes(uid.bytes).hex()


def membership(group, rank, world_size, unique_id) -> tuple[int, int, bytes]:
    """(rank, world size, id bytes) from Communicator's arguments, torch.distributed or the environment."""
    if unique_id is not None:
        raw = unique_id if isinstance(unique_id, bytes) else parse_id(unique_id)
        if rank is None or world_size is None:
            raise ValueError("tandem.Communicator: unique_id needs rank and world_size too")
        return int(rank), int(world_size), raw
    import torch.distributed as dist
    if group is not None or (dist.is_available() and dist.is_initialized()):
        return _from_store(group)
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    env = os.environ.get("TANDEM_ID")
    if env:
        return rank, world_size, parse_id(env)
    if world_size == 1:
        return rank, world_size, bytes.fromhex(new_id())
    raise ValueError(
        f"tandem.Communicator: rank {rank} of {world_size} needs the communicator's id: set TANDEM_ID to the "
        "same 32 hex digits on every rank (tandemctl new-id), or call torch.distributed.init_process_group() "
        "first (the id then travels through its store), or pass unique_id=, rank= and world_size=")


def _from_store(group) -> tuple[int, int, bytes]:
    """Rank 0 of the group makes the id and publishes it in the default store; the others read it there."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    if group is None:
        group = c10d._get_default_group()
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    store = c10d._get_default_store()
    name = getattr(group, "group_name", None) or "default"
    with _store_lock:  # every rank creates its communicators of a group in the same order: same key
        n = _store_counters.get(name, 0)
        _store_counters[name] = n + 1
    key = f"tandem/unique_id/{name}/{n}"
    if rank == 0:
        raw = bytes.fromhex(new_id())
        store.set(key, raw.hex())
    else:
        raw = bytes.fromhex(store.get(key).decode())
    return rank, world_size, raw
