"""The layering of ``src/ems``, asserted from the imports (a wrong arrow fails CI
instead of waiting for a reviewer):

* ``protocol`` imports nothing of ours but ``errors``;
* ``pool`` imports nothing of ours;
* ``client`` never imports ``server``, ``server`` never imports ``client``, nor
  ``control`` (the sealing both share is ``ems.sealing``, which imports only ``errors``);
* of the client, only the embedded transport imports ``pool`` (it runs the pool core
  in-process); the daemon's client shares only ``protocol`` with the daemon;
* ``cluster`` imports neither ``client`` nor ``server``;
* ``disk`` (the disk store engine) imports nothing of ours but ``errors``;
* ``settings`` (the declarations' generic code) imports nothing of ours but ``errors``,
  so every configuration, the SDK's included, may use it;
* no core module imports the top-level ``ems`` package (its public names): ``bench``,
  ``demo``, ``testing``, ``integrations`` and the command-line entry points are its
  users and may;
* the daemon's tiers (``ems.server.*_tier``) never import each other: they meet only
  at the seam (``ems.server.tiers``);
* no import cycles among our modules (imports inside functions included);
* no core module, nor ``control``, imports ``testing`` (test kits live there, not in
  the product);
* of the demo, ``hosts`` and ``runner`` share their passes through ``passes`` and do
  not import each other's internals (``runner`` starts ``hosts`` by its entry point);
* of the vLLM connector (``ems.integrations.vllm``), only the façade (``connector``)
  imports its halves (``scheduler``, ``worker``): the halves never import each other,
  they meet at ``metadata`` and share ``half``;
* the daemon does not load the SDK (``import ems.server.daemon`` leaves
  ``ems.client`` unimported, and ``import ems`` is lazy).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ems"
CORE = ("errors", "config", "keys", "futures", "client", "pool", "protocol", "server",
        "cluster", "disk", "settings")
VLLM = "ems.integrations.vllm"
VLLM_HALVES = (f"{VLLM}.scheduler", f"{VLLM}.worker")


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        yield ".".join(["ems", *parts]), path


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in ``path``, also inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations() -> list[str]:
    bad = []
    for module, path in _modules():
        area = _area(module)
        for target, names in _imports(path):
            if target != "ems" and not target.startswith("ems."):
                continue
            to = _area(target)
            if area == "protocol" and to not in ("protocol", "errors"):
                bad.append(f"{module} imports {target}: protocol may import only errors")
            if area == "pool" and to != "pool":
                bad.append(f"{module} imports {target}: pool imports nothing of ours")
            if area == "client" and to == "server":
                bad.append(f"{module} imports {target}: the client never imports the daemon")
            if area == "client" and to == "pool" and module != "ems.client.embedded":
                bad.append(f"{module} imports {target}: only the embedded pool runs the core")
            if area == "server" and to == "client":
                bad.append(f"{module} imports {target}: the daemon never imports the client")
            if area == "server" and to == "control":
                bad.append(f"{module} imports {target}: the daemon never imports the control "
                           f"plane (shared sealing lives in ems.sealing)")
            if area == "sealing" and to not in ("sealing", "errors"):
                bad.append(f"{module} imports {target}: sealing may import only errors")
            if area == "disk" and to not in ("disk", "errors"):
                bad.append(f"{module} imports {target}: the disk store is a pure engine")
            if area == "settings" and to not in ("settings", "errors"):
                bad.append(f"{module} imports {target}: settings may import only errors")
            if area == "cluster" and to in ("client", "server"):
                bad.append(f"{module} imports {target}: the cluster parts are pure")
            if (area in CORE or area == "control") and to == "testing":
                bad.append(f"{module} imports {target}: test kits are not part of the product")
            if module == "ems.demo.hosts" and (target == "ems.demo.runner" or (
                    target == "ems.demo" and "runner" in names)):
                bad.append(f"{module} imports {target}: the shared passes are ems.demo.passes")
            if module == "ems.demo.runner" and target == "ems.demo.hosts" and \
                    names != ["run_hosts"]:
                bad.append(f"{module} imports {target} beyond its entry point run_hosts")
            halves = [t for t in (target, *(f"{target}.{n}" for n in names))
                      if t in VLLM_HALVES and t != module]
            if halves and module != f"{VLLM}.connector":
                bad.append(f"{module} imports {halves[0]}: only the vLLM connector's "
                           f"façade imports its halves")
            if area in CORE and target == "ems":
                public = [n for n in names if not n.startswith("_")]
                if public or not names:
                    bad.append(f"{module} imports the top-level ems package ({public})")
    return bad


def test_the_layering_holds():
    assert _violations() == []


def _tier(module: str) -> bool:
    return module.startswith("ems.server.") and module.endswith("_tier")


def test_tiers_never_import_each_other():
    bad = [f"{module} imports {target}"
           for module, path in _modules() if _tier(module)
           for target, _ in _imports(path) if _tier(target) and target != module]
    assert bad == []


def _graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (``from pkg import mod`` resolved)."""
    ours = {module for module, _ in _modules()}
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        edges = set()
        for target, names in _imports(path):
            for name in names:
                if f"{target}.{name}" in ours:
                    edges.add(f"{target}.{name}")
            if target in ours and (not names or any(f"{target}.{n}" not in ours
                                                    for n in names)):
                edges.add(target)
        edges.discard(module)
        graph[module] = edges
    return graph


def test_no_import_cycles():
    """A package's ``__init__`` importing its own modules is not a cycle of ours to
    fix (Python resolves it), so edges into a package's ``__init__`` from inside
    that package are left out."""
    graph = _graph()
    for module, edges in graph.items():
        graph[module] = {t for t in edges
                         if not (module.startswith(t + ".") and t in graph)}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("code, forbidden", [
    ("import ems.server.daemon", "ems.client"),
    ("import ems", "ems.client"),
    ("import ems.protocol", "ems.pool"),
])
def test_lazy_imports(code, forbidden):
    probe = (f"import sys; {code}; "
             f"print(any(m == {forbidden!r} or m.startswith({forbidden!r} + '.') "
             f"for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr
