"""``ems demo``: prefix caching in a real decoding loop, exact outputs, time saved.

A small Llama-style model (random weights from a fixed seed: there is no model
download on this machine) with a paged KV cache runs a shared-prefix workload
without and with ems; see :mod:`ems.demo.runner`. Needs torch.

``main`` imports torch only when called, so ``import ems.demo`` is cheap and works
where torch is absent.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``ems demo`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    from ems.demo.runner import main as run

    return run(argv)
