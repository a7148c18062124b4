"""What crosses from the scheduler's half to the worker's, once per step (vLLM carries
it in the ``SchedulerOutput``, pickled where the worker is another process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["BlockTransfer", "EmsConnectorMetadata"]


class BlockTransfer(NamedTuple):
    """Blocks of one request to move: per KV cache group, the engine's block ids of
    these blocks (``block_ids[g][i]``: block ``i`` in group ``g``), and their keys."""

    req_id: str
    block_ids: list[list[int]]
    hashes: list[int]
    #: each block's identity (its 32-byte digest), checked after a load
    identities: list[bytes]
    #: a save's vLLM block hashes as vLLM publishes them in its KV events (the pool's
    #: KV events carry them; empty: not known)
    event_hashes: Sequence[int] = ()
    #: an asynchronous load (hybrid models): reported in finished_recving, and a
    #: failure in failed_recving (the whole request is recomputed)
    is_async: bool = False
    #: a save's ``CcKvOption.write_out`` (the request's ``ems_write_out``)
    write_out: bool = True


@dataclasses.dataclass
class EmsConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)
