"""Writes the test timings of docs/testing.md from a pytest run's report.

    python scripts/test_durations.py --run               # run the fast loop, then write
    python scripts/test_durations.py --run --run-slow    # the full run
    python scripts/test_durations.py --junitxml PATH     # from a saved report instead
    python scripts/test_durations.py --check             # exit 1 if the block differs

``--run`` runs ``python -m pytest -p no:cacheprovider -q --durations=0 --junitxml=...``
(with ``--run-slow`` the full run) and reads the report it saves; ``--junitxml PATH``
reads one saved by such a run (``--kind full`` when it was a full run). Either writes
``docs/test-durations.json``: per test file its tests and seconds (setup, call and
teardown, as pytest's junit report times each test), and the totals of the fast loop
and of the full run (each kept from the JSON until a run of its kind replaces it), then
rewrites the block between ``<!-- generated: test-durations -->`` and ``<!-- end:
test-durations -->`` in docs/testing.md, as ``scripts/bench_tables.py`` does for the
benchmark page. ``--check`` only renders the block from the committed JSON and compares
(``scripts/test.sh`` runs it); it never runs pytest.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGE = DOCS / "testing.md"
JSON_PATH = DOCS / "test-durations.json"
BLOCK = "test-durations"
#: the slowest files shown on the page (the JSON holds every file)
SLOWEST = 15


def _file_of(classname: str) -> str:
    """The test file of a junit ``classname`` (``tests.unit.test_pool.TestX``)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (ROOT / path).is_file():
            return path
    return "/".join(parts) + ".py"


def read_report(path: Path) -> dict[str, Any]:
    """Per file (tests, seconds) and the run's totals from a junit XML report."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    files: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: {"tests": 0, "seconds": 0.0})
    totals = {"tests": 0, "skipped": 0, "failed": 0, "seconds": 0.0, "wall_s": 0.0}
    for suite in suites:
        totals["wall_s"] += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            row = files[_file_of(case.get("classname", ""))]
            seconds = float(case.get("time", 0.0))
            row["tests"] += 1
            row["seconds"] += seconds
            totals["tests"] += 1
            totals["seconds"] += seconds
            if case.find("skipped") is not None:
                totals["skipped"] += 1
            if case.find("failure") is not None or case.find("error") is not None:
                totals["failed"] += 1
    rounded = {f: {"tests": int(r["tests"]), "seconds": round(r["seconds"], 2)}
               for f, r in sorted(files.items())}
    totals["seconds"] = round(totals["seconds"], 1)
    totals["wall_s"] = round(totals["wall_s"], 1)
    return {"files": rounded, "totals": totals}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out + (" (dirty)" if dirty else "")


def record(report: dict[str, Any], kind: str, command: str) -> dict[str, Any]:
    """The JSON after a run of ``kind`` (``fast`` or ``full``): its files and totals
    replace those of the last run of that kind; the other kind's totals are kept."""
    old: dict[str, Any] = {}
    if JSON_PATH.exists():
        old = json.loads(JSON_PATH.read_text())
    totals = dict(old.get("totals", {}))
    totals[kind] = {**report["totals"], "date": datetime.date.today().isoformat(),
                    "commit": _commit(), "command": command,
                    "machine": f"{os.cpu_count()} CPUs, 15-min load {os.getloadavg()[2]:.1f}, "
                               f"Python {platform.python_version()}"}
    totals.setdefault("fast", None)
    totals.setdefault("full", None)
    files = report["files"] if kind == "fast" or not old.get("files") else old["files"]
    return {"files_from": kind if files is report["files"] else old.get("files_from"),
            "files": files, "totals": totals}


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def render_block(data: dict[str, Any]) -> str:
    files: dict[str, dict[str, Any]] = data["files"]
    lines = []
    for kind, what in (("fast", "The fast loop (a plain `pytest`)"),
                       ("full", "The full run (`pytest --run-slow`)")):
        t = data["totals"].get(kind)
        if t is None:
            lines.append(f"* {what}: not in this JSON; its figure is from the CI log "
                         f"(see above).")
            continue
        lines.append(f"* {what}: {t['tests']} tests ({t['skipped']} skipped) in "
                     f"{_minutes(t['wall_s'])} wall, {t['seconds']:.0f} s of test time; "
                     f"`{t['command']}` on {t['date']} at {t['commit']} ({t['machine']}).")
    suites: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for path, row in files.items():
        parts = path.split("/")
        suite = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        suites[suite][0] += row["tests"]
        suites[suite][1] += row["seconds"]
    lines += ["", f"Per suite ({data.get('files_from') or 'fast'} run):", "",
              "| suite | tests | seconds |", "|---|---:|---:|"]
    for suite, (n, s) in sorted(suites.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{suite}` | {n:.0f} | {s:.1f} |")
    lines += ["", f"The {SLOWEST} slowest files:", "",
              "| file | tests | seconds |", "|---|---:|---:|"]
    slowest = sorted(files.items(), key=lambda kv: -kv[1]["seconds"])[:SLOWEST]
    for path, row in slowest:
        lines.append(f"| `{path}` | {row['tests']} | {row['seconds']:.1f} |")
    return "\n".join(lines)


def render(text: str, data: dict[str, Any]) -> str:
    pattern = re.compile(rf"(<!-- generated: {BLOCK} -->\n).*?(<!-- end: {BLOCK} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs/testing.md: no block '{BLOCK}' (<!-- generated: {BLOCK} -->)")
    body = render_block(data)
    return pattern.sub(lambda m: f"{m.group(1)}{body}\n{m.group(2)}", text)


def run_pytest(run_slow: bool, xml: Path, extra: list[str]) -> tuple[int, str]:
    argv = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "--durations=0",
            f"--junitxml={xml}", *(["--run-slow"] if run_slow else []), *extra]
    shown = "python " + " ".join(a for a in argv if not a.startswith("--junitxml"))
    rc = subprocess.call([sys.executable, *argv], cwd=ROOT)
    return rc, shown


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--run", action="store_true", help="run pytest, then write")
    how.add_argument("--junitxml", type=Path, help="read this saved junit report")
    how.add_argument("--check", action="store_true",
                     help="change nothing; exit 1 if the page's block differs from the JSON")
    ap.add_argument("--run-slow", action="store_true", help="with --run: the full run")
    ap.add_argument("--kind", choices=("fast", "full"), default="fast",
                    help="with --junitxml: which run the report is of")
    ap.add_argument("--command", default="python -m pytest -p no:cacheprovider -q "
                    "--durations=0", help="with --junitxml: the command that made it")
    ap.add_argument("pytest_args", nargs="*", help="with --run: more pytest arguments")
    args = ap.parse_args(argv)
    if args.check:
        data = json.loads(JSON_PATH.read_text())
        old = PAGE.read_text()
        if render(old, data) != old:
            print("docs/testing.md: the test timings differ from docs/test-durations.json; "
                  "run python scripts/test_durations.py --junitxml REPORT (or --run)",
                  file=sys.stderr)
            return 1
        return 0
    rc = 0
    if args.run:
        with tempfile.TemporaryDirectory() as tmp:
            xml = Path(tmp) / "report.xml"
            rc, command = run_pytest(args.run_slow, xml, args.pytest_args)
            report = read_report(xml)
        kind = "full" if args.run_slow else "fast"
    else:
        report, kind, command = read_report(args.junitxml), args.kind, args.command
    data = record(report, kind, command)
    JSON_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    PAGE.write_text(render(PAGE.read_text(), data))
    t = data["totals"][kind]
    print(f"wrote {JSON_PATH.relative_to(ROOT)} and the block of docs/testing.md: "
          f"{kind} run, {t['tests']} tests, {t['wall_s']} s wall")
    return rc


if __name__ == "__main__":
    sys.exit(main())
