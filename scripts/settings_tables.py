"""Writes the settings tables of the docs from the declarations (``ems.settings``).

    python scripts/settings_tables.py           # rewrite the generated blocks in place
    python scripts/settings_tables.py --check   # exit 1 if a block differs (scripts/test.sh)

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` in its
page (as the benchmark tables of ``scripts/bench_tables.py`` do); everything else on
the page is written by hand. A setting's default, doc line, file key, environment
variable and flag are declared once, in its configuration's dataclass; this script
only renders them, so a page never shows a setting, a default or a variable that the
code does not declare.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "src"))  # the tree's own ems, installed or not


def _blocks() -> dict[str, tuple[str, Callable[[], str]]]:
    from ems.config import PoolSettings
    from ems.control.cli import ShellConfig
    from ems.control.config import ControlConfig
    from ems.integrations.settings import ConnectorSettings, StorageSettings
    from ems.server.config import DiskConfig, Limits, ServerConfig
    from ems.settings import markdown_table as table

    return {
        "settings-server": ("daemon.md", lambda: table(ServerConfig, nested=False)),
        "settings-limits": ("daemon.md", lambda: table(Limits, key_prefix="limits.")),
        "settings-disk": ("tiers/disk.md", lambda: table(DiskConfig, key_prefix="disk.")),
        "settings-control": ("control-plane.md", lambda: table(ControlConfig)),
        "settings-control-cli": ("control-plane.md", lambda: table(ShellConfig)),
        "settings-sdk": ("sdk.md", lambda: table(PoolSettings)),
        "settings-vllm": ("vllm.md", lambda: table(
            ConnectorSettings, key_heading="extra config key", env_prefix="EMS_VLLM_")),
        "settings-sglang": ("sglang.md", lambda: table(
            StorageSettings, key_heading="extra config key", env_prefix="EMS_SGLANG_")),
    }


def render(page: str, text: str) -> str:
    """``text`` (the page ``page``) with its generated blocks rewritten."""
    for name, (where, make) in _blocks().items():
        if where != page:
            continue
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs/{page}: no block '{name}' (<!-- generated: {name} -->)")
        body = make()
        text = pattern.sub(lambda m, b=body: f"{m.group(1)}{b}\n{m.group(2)}", text)
    return text


def pages() -> list[str]:
    return sorted({where for where, _ in _blocks().values()})


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a page's tables differ from the code")
    args = ap.parse_args(argv)
    stale = []
    for page in pages():
        path = DOCS / page
        old = path.read_text()
        new = render(page, old)
        if new == old:
            continue
        if args.check:
            stale.append(page)
        else:
            path.write_text(new)
            print(f"rewrote the settings tables of docs/{page}")
    if stale:
        print(f"{', '.join(stale)}: the settings tables differ from the declarations; "
              "run python scripts/settings_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
