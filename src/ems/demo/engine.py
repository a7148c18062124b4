"""A one-request-at-a-time inference engine: prefill (with or without ems), greedy decode.

The engine owns the model, its paged KV cache and the scheduler. Without a
connector every request prefills its whole prompt. With an
:class:`~ems.demo.connector.EmsConnector` it first loads the leading blocks the
pool holds, prefills only the rest (positions continue after the loaded prefix,
attention covers loaded and new KV alike), saves the full blocks it computed, and
collects those saves before freeing the request's blocks.

Freed blocks are filled with NaN (``poison_freed``, on by default): the FIFO free
list would otherwise hand the next request of the same prefix blocks still
holding the right KV, and a load that silently wrote nothing would go unnoticed.
With poisoned blocks such a load turns the outputs into NaN and the demo fails.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ems.demo.connector import EmsConnector
from ems.demo.model import LlamaModel
from ems.demo.scheduler import Request, Scheduler, block_hashes

__all__ = ["Engine", "RequestStats", "Workload", "make_workload"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Prompts sharing a few prefixes: ``prefixes`` groups of ``requests`` each."""

    prefixes: int = 3
    requests: int = 8
    """Requests per prefix."""
    prefix_tokens: int = 1536
    suffix_tokens: int = 128
    decode_tokens: int = 8
    seed: int = 0

    @property
    def prompt_tokens(self) -> int:
        """Length of every prompt."""
        return self.prefix_tokens + self.suffix_tokens


def make_workload(workload: Workload, vocab_size: int) -> list[Request]:
    """Deterministic prompts: a shared prefix per group plus a unique suffix each.

    Requests of the groups are interleaved (group 0, 1, 2, 0, 1, 2, ...), as the
    users of a service sharing a few system prompts would arrive.
    """
    rng = random.Random(workload.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    prefixes = [tokens(workload.prefix_tokens) for _ in range(workload.prefixes)]
    requests = []
    for i in range(workload.requests):
        for group, prefix in enumerate(prefixes):
            requests.append(Request(request_id=f"g{group}-r{i}",
                                    prompt=prefix + tokens(workload.suffix_tokens),
                                    max_new_tokens=workload.decode_tokens, group=group))
    return requests


@dataclasses.dataclass
class RequestStats:
    """What one request cost and produced."""

    request_id: str
    group: int
    prompt_tokens: int
    loaded_tokens: int = 0
    computed_tokens: int = 0
    saved_blocks: int = 0
    prefill_s: float = 0.0
    """Wall time from admission to the first token: lookup, load, compute, save submit."""
    load_s: float = 0.0
    """Part of ``prefill_s`` spent in ``exists`` and ``load``."""
    decode_s: float = 0.0
    save_wait_s: float = 0.0
    """Time spent collecting save futures after decoding (before freeing blocks)."""
    output: list[int] = dataclasses.field(default_factory=list)
    logits: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    """``[decode_tokens, vocab]``: the logits each generated token was chosen from."""

    def to_json(self) -> dict[str, object]:
        """The stats without the logits tensor."""
        data = dataclasses.asdict(self)
        data.pop("logits")
        return data


class Engine:
    """Model + paged KV cache + scheduler, running requests one after another."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 poison_freed: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.scheduler = Scheduler(num_blocks, block_size)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.poison_freed = poison_freed
        self.connector: Optional[EmsConnector] = None
        self.reset()

    def block_bytes(self) -> int:
        """Bytes of one block's K and V over all layers: what one pool key holds."""
        return self.block_size * self.model.config.kv_bytes_per_token()

    def reset(self) -> None:
        """Forget every request: all blocks free and (if poisoning) NaN."""
        self.scheduler = Scheduler(self.scheduler.allocator.num_blocks, self.block_size)
        if self.poison_freed:
            for layer in self.kv_caches:
                for cache in layer:
                    cache.fill_(float("nan"))

    def attach(self, connector: Optional[EmsConnector]) -> None:
        """Use ``connector`` for the next requests (``None``: no cache); registers the KV."""
        if connector is not None:
            connector.register(self.kv_caches)
        self.connector = connector

    def run(self, request: Request) -> RequestStats:
        """Prefill and greedily decode ``request``, then free its blocks."""
        model, bs, conn = self.model, self.block_size, self.connector
        prompt = request.prompt
        stats = RequestStats(request.request_id, request.group, len(prompt))
        request.output = []
        t0 = time.perf_counter()
        self.scheduler.reserve(request, len(prompt))
        hashes = block_hashes(prompt, bs) if conn is not None else []
        loaded_blocks = 0
        if conn is not None:
            # At least one prompt token must be computed to get the first logits.
            loaded_blocks = conn.load(hashes[:(len(prompt) - 1) // bs], request.block_table)
            stats.load_s = time.perf_counter() - t0
        start = loaded_blocks * bs
        table = torch.tensor(request.block_table)
        logits = model.forward_paged(torch.tensor(prompt[start:]), start, table, self.kv_caches)
        if conn is not None:
            conn.save_async(request.request_id, hashes[loaded_blocks:],
                            request.block_table, loaded_blocks)
        stats.prefill_s = time.perf_counter() - t0
        stats.loaded_tokens, stats.computed_tokens = start, len(prompt) - start

        t0 = time.perf_counter()
        steps = [logits]
        while True:
            request.output.append(int(torch.argmax(logits)))
            if len(request.output) >= request.max_new_tokens:
                break
            new = self.scheduler.reserve(request, request.num_tokens)
            if new:
                table = torch.tensor(request.block_table)
            logits = model.forward_paged(torch.tensor(request.output[-1:]),
                                         request.num_tokens - 1, table, self.kv_caches)
            steps.append(logits)
        stats.decode_s = time.perf_counter() - t0
        stats.output = list(request.output)
        stats.logits = torch.stack(steps)

        if conn is not None:
            t0 = time.perf_counter()
            stats.saved_blocks = conn.wait_saves(request.request_id)
            stats.save_wait_s = time.perf_counter() - t0
        self._free(request)
        return stats

    def _free(self, request: Request) -> None:
        freed = self.scheduler.finish(request)
        if self.poison_freed and freed:
            index = torch.tensor(freed)
            for layer in self.kv_caches:
                for cache in layer:
                    cache.index_fill_(0, index, float("nan"))

    def run_all(self, requests: Sequence[Request],
                on_done: Optional[Callable[[RequestStats], None]] = None
                ) -> list[RequestStats]:
        """Run ``requests`` in order; ``on_done`` is called after each (progress)."""
        results = []
        for request in requests:
            results.append(self.run(request))
            if on_done is not None:
                on_done(results[-1])
        return results
