"""Integrations of the ems pool with inference engines.

* :mod:`ems.integrations.vllm` -- ``EmsConnector``, a vLLM ``KVConnectorBase_V1``
  (load it by module path: ``kv_connector_module_path="ems.integrations.vllm"``).
* :mod:`ems.integrations.settings` -- the connector's frozen, validated settings.
* :mod:`ems.integrations.session` -- the process-wide pool session both connector
  roles share: init, layout registration, deadlines, the health loop.
* :mod:`ems.integrations.kv_layout` -- vLLM's cache layouts as ems registers them, and
  the 64-bit keys of its block hashes.

Only ``vllm`` imports vLLM; the other modules need neither vLLM nor a GPU, so they
are unit-tested in the project's own environment.
"""
