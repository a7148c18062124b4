"""``EmsConnector``: the ems pool as the KV-cache tier of a vLLM engine (KV connector v1).

    --kv-transfer-config '{"kv_connector": "EmsConnector",
                           "kv_connector_module_path": "ems.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"pool": "server"}}'

vLLM makes two instances: the SCHEDULER role (the engine-core process, no KV tensors)
and the WORKER role (one per rank). They share only the metadata the scheduler builds
each step (:class:`EmsConnectorMetadata`) and what the worker reports back.

A request's life, as the connector sees it::

    scheduler                                   worker (same step)
    get_num_new_matched_tokens  -- exists(leading full prompt blocks) within
        |                          lookup_timeout_ms; never the last prompt token
    update_state_after_alloc    -- remember the hit (local blocks + pool blocks)
    build_connector_meta        -- loads: pool blocks -> their allocated block ids
        |                          saves: full prompt blocks computed by this step
        |                          (every chunk of a chunked prefill)
        +------ metadata ------> handle_preemptions: wait for saves of preempted reqs
                                 start_load_kv: load, wait (SDK deadline); a miss or a
                                                failure -> get_block_ids_with_load_errors
                                                -> vLLM recomputes those tokens
                                 (forward)
                                 wait_for_save: submit the step's saves, return at once
    request_finished            -- True when saves were planned: vLLM keeps the blocks
        |                          until the worker reports the request in
        +<-- finished_sending -- get_finished, once every save of it is done

Block keys (:mod:`ems.integrations.block_keys`): ems's own prefix chain of sha256
over each block's tokens and vLLM's extra keys (LoRA, multimodal hashes, cache salt),
never vLLM's block hashes, which depend on ``PYTHONHASHSEED`` and on
``prefix_caching_hash_algo`` (random per process for xxhash): the same tokens give the
same keys in every engine, process, restart and host. The scheduler computes them and
sends them in the metadata, so the worker uses the very same numbers. A key is 64
bits; the block's whole 32-byte digest travels with it in the pool object (an
identity page, registered as one more layer) and is compared after every load: a
collision is a miss, recomputed, never the wrong KV.

Hybrid models (``SupportsHMA``, vLLM's hybrid KV cache manager): each KV cache group's
layers are an SDK layer group with its own block ids, one pool object per block holds
every group's pages of it (a hit is the minimum over groups, a restore never partial),
loads are asynchronous (vLLM maps their failures to requests), and saves of
sliding-window blocks are copied before the step ends: see :mod:`ems.integrations.kv_layout`
and docs/vllm-hybrid.md. Saves carry vLLM's own block hashes (``event_hashes``), which a
daemon with ``--kv-events`` publishes (docs/kv-events.md).

Layouts (``register_kv_caches``): vLLM's CPU pages (0.32 hands them over as
``[num_blocks, kv_heads, block_size, 2*head_size]``, the attention views the same
storage as ``[num_blocks, kv_heads, 2*block_size, head_size]``: a block's K rows then
its V rows, per head) are viewed as the latter and registered as opaque pages of
``block_size`` tokens; split K/V layouts (``[2, num_blocks, block_size, heads,
head]``) as two paged tensors per layer; MLA ``[num_blocks, block_size, dim]`` as
one. Only whole blocks ever move. The pool object of a block holds every layer of this
rank, so loads and saves happen once per step, not per layer. TP and PP ranks keep
separate keys (the SDK's ``CcConfig_v1``); with MLA all TP ranks share them and only
TP rank 0 saves.

The pool down, slow, full or refusing: see :mod:`ems.integrations.session`; every hook
returns within its deadline and the engine serves without the cache meanwhile.

The package, by role (vLLM's ``OffloadingConnector`` is built the same way):

* :mod:`~ems.integrations.vllm.connector` -- ``EmsConnector``, the class vLLM loads: a
  thin façade that builds the half of its role and hands each hook to it;
* :mod:`~ems.integrations.vllm.scheduler` -- the scheduler's half (lookups, plans);
* :mod:`~ems.integrations.vllm.worker` -- the worker's half (registration, loads,
  saves); the two halves never import each other;
* :mod:`~ems.integrations.vllm.metadata` -- what crosses from one to the other;
* :mod:`~ems.integrations.vllm.half` -- what both share (the KV cache groups, the
  counters, the pool session, ``@_timed``);
* :mod:`~ems.integrations.vllm.compat` -- every read of vLLM that differs by version;
* :mod:`~ems.integrations.vllm.stats` -- the counters and vLLM's stats class.
"""

from __future__ import annotations

from ems.integrations.vllm.connector import EmsConnector
from ems.integrations.vllm.metadata import EmsConnectorMetadata
from ems.integrations.vllm.stats import ConnectorStatistics, EmsConnectorStats

__all__ = ["ConnectorStatistics", "EmsConnector", "EmsConnectorMetadata",
           "EmsConnectorStats"]
