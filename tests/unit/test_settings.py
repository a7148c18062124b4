"""Each setting is declared once (``ems.settings``): the generic merge, refusal, check
and flags behave as the declarations say, and nothing outside them names a setting: a
flag of ``ems-server`` / ``ems-control``, an ``EMS_*`` variable read by the code or
named by the docs, and a row of a docs settings table all have a declaration."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Mapping, Optional

import pytest

from ems.config import PoolSettings
from ems.control.config import ControlConfig
from ems.errors import EmsErrorCode, EmsException
from ems.integrations.settings import ConnectorSettings, StorageSettings
from ems.server.config import CONFIG_FILE, ServerConfig
from ems.settings import (
    Integer,
    Layer,
    Size,
    all_env_names,
    check_fields,
    flag_names,
    load,
    section,
    setting,
    table,
)

ROOT = Path(__file__).resolve().parents[2]

#: every configuration and the prefix its ``{prefix}`` variables take
CONFIGS: list[tuple[type, str]] = [
    (ServerConfig, ""), (ControlConfig, ""), (PoolSettings, ""),
    (ConnectorSettings, "EMS_VLLM_"), (StorageSettings, "EMS_SGLANG_"),
]
#: ``EMS_*`` names that are not settings: the error codes, and these
NOT_SETTINGS = {
    "EMS_BENCH_LMCACHE": "a switch of benchmarks/ (which peer to start), not of ems",
    "EMS_FAULT_FIGURES": "a switch of the fault tests' figure writer (docs/testing.md)",
}


def _declared_env() -> set[str]:
    out = {*CONFIG_FILE.env}
    for cls, prefix in CONFIGS:
        out |= all_env_names(cls, prefix)
    return out


def _not_settings() -> set[str]:
    return {c.name for c in EmsErrorCode} | set(NOT_SETTINGS)


# ------------------------------------------------------------ the generic code

@dataclasses.dataclass(frozen=True)
class _Inner:
    size_bytes: int = setting("a size", Size(), default=1 << 20, key="size",
                              env="T_INNER_SIZE", flag="--inner-size")

    def __post_init__(self) -> None:
        check_fields(self, "inner.")


@dataclasses.dataclass(frozen=True)
class _Toy:
    count: int = setting("a count", Integer(0, 10), default=3, env="T_COUNT",
                         flag="--count")
    name: Optional[str] = setting("a name", lambda raw, where: str(raw), default=None,
                                  key=None, env="T_NAME")
    per: Mapping[str, int] = table("per id", Integer(1), key="per", pairs_flag="--per")
    inner: _Inner = section("inner", _Inner, key="inner", pairs_flag="--inner")

    def __post_init__(self) -> None:
        check_fields(self)


def test_a_later_layer_wins_and_a_blank_variable_is_unset():
    file = Layer.table({"count": 1, "per": {"a": 2}, "inner": {"size": "2M"}}, "f.toml")
    assert load(_Toy, []) == _Toy()
    assert load(_Toy, [file]).count == 1
    assert load(_Toy, [file, Layer.environ({"T_COUNT": "4"})]).count == 4
    assert load(_Toy, [file, Layer.environ({"T_COUNT": "  "})]).count == 1
    toy = load(_Toy, [file, Layer.environ({"T_COUNT": "4", "T_INNER_SIZE": "3M"}),
                      Layer.flags({"count": "5", "per": ["b=7"], "inner": ["size=4M"]})])
    assert (toy.count, toy.per, toy.inner.size_bytes) == (5, {"a": 2, "b": 7}, 4 << 20)
    assert load(_Toy, [Layer.flags({"inner_size": "5M"})]).inner.size_bytes == 5 << 20


@pytest.mark.parametrize("layers, words", [
    ([Layer.table({"colour": 1}, "f.toml")], "f.toml: unknown key(s) colour; known: "),
    ([Layer.table({"inner": {"colour": 1}}, "f.toml")], "inner: unknown key(s) colour"),
    ([Layer.table({"inner": 3}, "f.toml")], "inner must be a table"),
    ([Layer.table({"name": "x"}, "f.toml")], "unknown key(s) name"),  # not a file key
    ([Layer.table({"count": 11}, "f.toml")], "count must be an int in 0..10, got 11"),
    ([Layer.environ({"T_COUNT": "many"})], "T_COUNT must be an int in 0..10"),
    ([Layer.flags({"count": "-1"})], "count must be an int in 0..10"),
    ([Layer.flags({"per": ["b"]})], "--per takes NAME=VALUE"),
    ([Layer.flags({"inner": ["size=lots"]})], "inner.size must be a byte count"),
    ([Layer.table({"per": {"a": 0}}, "x", quoted=True)], "per.a must be an int >= 1"),
])
def test_bad_input_is_refused_naming_where_it_came_from(layers, words):
    with pytest.raises(EmsException) as info:
        load(_Toy, layers)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert words in info.value.message()


def test_construction_runs_the_same_parsers():
    with pytest.raises(EmsException, match="count must be an int in 0..10"):
        _Toy(count=11)
    with pytest.raises(EmsException, match="spin_us must be an int in 0..1000000"):
        ServerConfig(spin_us=-1)
    assert ServerConfig(log_level="debug").log_level == "DEBUG"  # kept as parsed


def test_the_flags_come_from_the_declarations():
    p = argparse.ArgumentParser()
    from ems.settings import add_flags
    add_flags(p, _Toy)
    args = vars(p.parse_args(["--count", "2", "--per", "a=1", "--per", "b=2",
                              "--inner", "size=1M", "--inner-size", "2M"]))
    assert load(_Toy, [Layer.flags(args)]).per == {"a": 1, "b": 2}
    # --inner NAME=VALUE is applied after the section's own flags
    assert load(_Toy, [Layer.flags(args)]).inner.size_bytes == 1 << 20


# ------------------------------------------------- nothing names an undeclared one

def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def test_every_flag_of_the_daemon_and_the_control_plane_is_declared():
    from ems.control.__main__ import _parser as control_parser
    from ems.server.__main__ import _parser as server_parser
    server = flag_names(ServerConfig) | {CONFIG_FILE.flag or ""}
    negated = {"--no-anonymous"}  # the Boolean declaration's other half
    assert _options(server_parser()) == server | negated
    assert _options(control_parser()) == flag_names(ControlConfig)


def _env_literals(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= set(re.findall(r"\bEMS_[A-Z][A-Z0-9_]*", node.value))
    return names


def test_every_environment_variable_the_code_names_is_declared():
    declared = _declared_env()
    prefixes = {p for _, p in CONFIGS if p} | {"EMS_IO_"}  # a docstring names the codes
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "ems").rglob("*.py")):
        for name in _env_literals(path):
            found.setdefault(name, str(path.relative_to(ROOT)))
    undeclared = {name: where for name, where in found.items()
                  if name not in declared and name not in _not_settings()
                  and name not in prefixes}
    assert not undeclared, f"EMS_* names without a declaration: {undeclared}"


def test_every_environment_variable_the_docs_name_is_declared():
    declared = _declared_env() | _not_settings()
    prefixes = {p for _, p in CONFIGS if p}
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    undeclared = {}
    for page in pages:
        for name in set(re.findall(r"\bEMS_[A-Z][A-Z0-9_]*", page.read_text())):
            if name not in declared and name not in prefixes:
                undeclared[name] = str(page.relative_to(ROOT))
    assert not undeclared, f"docs name EMS_* variables nobody declares: {undeclared}"


def test_every_row_of_the_docs_settings_tables_is_made_from_a_declaration():
    spec = importlib.util.spec_from_file_location("settings_tables",
                                                  ROOT / "scripts" / "settings_tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    for page in tables.pages():
        text = (ROOT / "docs" / page).read_text()
        assert tables.render(page, text) == text, (
            f"docs/{page}: a settings table differs from the declarations; run "
            "python scripts/settings_tables.py")
