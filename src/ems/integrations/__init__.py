"""Integrations of the ems pool with inference engines.

* :mod:`ems.integrations.vllm` -- ``EmsConnector``, a vLLM ``KVConnectorBase_V1``
  (load it by module path: ``kv_connector_module_path="ems.integrations.vllm"``).
* :mod:`ems.integrations.sglang` -- ``EmsStorage``, an SGLang ``HiCacheStorage`` (the L3
  of its hierarchical cache; load it through SGLang's ``dynamic`` storage backend).
* :mod:`ems.integrations.settings` -- the integrations' frozen, validated settings.
* :mod:`ems.integrations.session` -- the process-wide pool session (both vLLM connector
  roles share it): init, layout registration, deadlines, the health loop.
* :mod:`ems.integrations.kv_layout` -- vLLM's cache layouts as ems registers them, and
  the 64-bit keys of its block hashes.
* :mod:`ems.integrations.hicache` -- SGLang's host pools and page keys as ems sees them.
* :mod:`ems.integrations.counters` -- thread-safe counters behind a statistics dataclass.

Only ``vllm`` imports vLLM and only ``sglang`` imports SGLang; the other modules need
neither engine nor a GPU, so they are unit-tested in the project's own environment.
"""
