"""vLLM's own connector-stats path with EmsConnector's stats class (run in the venv).

vLLM resolves the connector class by module path (``KVConnectorFactory``), builds our
``KVConnectorStats`` from each step's dict (``build_kv_connector_stats``), aggregates
them and logs ``KV Transfer metrics: ...``. Prints that line; exits non-zero if the
figures are not the sums of what went in.
"""

from __future__ import annotations

import sys

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging


def main() -> int:
    ktc = KVTransferConfig(kv_connector="EmsConnector",
                           kv_connector_module_path="ems.integrations.vllm",
                           kv_role="kv_both")
    logging_ = KVConnectorLogging(ktc)
    logging_.observe({"lookups": 2, "tokens_looked_up": 640, "tokens_hit": 320})
    logging_.observe({"lookups": 1, "tokens_looked_up": 320, "tokens_hit": 160,
                      "tokens_loaded": 480, "load_s": 0.25})
    lines: list[str] = []
    logging_.log(lambda fmt, *a: lines.append(fmt % a))
    print("\n".join(lines))
    want = ("lookups=3", "tokens_looked_up=960", "tokens_hit=480", "tokens_loaded=480",
            "load_s=0.25", "hit_rate=0.5")
    ok = len(lines) == 1 and all(w in lines[0] for w in want)
    logging_.log(lambda fmt, *a: lines.append(fmt % a))  # reset: nothing more to log
    return 0 if ok and len(lines) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
