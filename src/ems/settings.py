"""One declaration per setting, and the generic code that every configuration shares.

A configuration is a frozen dataclass; each of its fields is declared once with
:func:`setting` (a scalar), :func:`section` (a nested configuration: ``[disk]``,
``[limits]``) or :func:`table` (``ID = VALUE`` pairs: ``[quotas]``). The declaration
holds everything about the setting: its default, its doc line, its file key, its
environment variable(s), its flag, and its parser (which is also its check). From the
declarations, and nothing else, this module makes

* the layered merge (:func:`load`): the layers are applied in the order given, a later
  one wins (the daemon: defaults < config file < environment < flags; an engine
  integration: defaults < environment < the engine's extra config), and a table layer
  refuses a key nobody declared (``EMS_INVALID_ARGUMENT`` naming it and the known
  ones);
* the check at construction (:func:`check_fields`, from ``__post_init__``): each
  field's parser runs on the value, so ``Limits(max_keys_per_request=0)`` is refused
  with the same message as ``--limit max_keys_per_request=0``; what relates two fields
  stays in the class;
* the command line (:func:`add_flags`): one argparse option per declared flag, its
  help from the doc line, the default and the environment variable;
* the docs' settings tables (:func:`markdown_table`; ``scripts/settings_tables.py``
  writes them into the pages and ``--check`` fails the test command when a page
  differs).

The layers::

    Layer.table(mapping, name)   a TOML file's table or an engine's extra config:
                                 keys are the declared ``key``s, sections nest
    Layer.environ(env, prefix)   the declared variables (``{prefix}`` filled in);
                                 a blank value counts as unset
    Layer.flags(mapping)         argparse's ``vars(args)``: the declared ``dest``s;
                                 None counts as not given; a value is named by its
                                 key in messages (``disk.capacity``), as in a file

A parser takes the raw value (text from the environment and the flags, a TOML value
from a file, a Python value at construction) and the name of where it came from
(``disk.capacity`` for a file or a flag, ``EMS_DISK_CAPACITY``), and returns the value
or raises :func:`ems.errors.invalid` naming that place and the rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

from ems.errors import invalid

__all__ = [
    "Boolean", "Choice", "Integer", "Layer", "Number", "Setting", "Size", "Text",
    "add_flags", "check_fields", "declared", "env_names", "flag_names", "load",
    "markdown_table", "parse_bytes", "section", "setting", "table",
]

_META = "ems.setting"
_T = TypeVar("_T")
#: a parser: (raw value, where it came from) -> the value (raises ``invalid``)
Parse = Callable[[Any, str], Any]


# ----------------------------------------------------------------------- parsers

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: Union[str, int], field: str = "size") -> int:
    """``"512M"``, ``"4g"``, ``"1048576"``, ``1048576`` -> bytes (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
        if not m:
            raise invalid(f"{field} must be a byte count like 4096, 512M or 4G, got {text!r}")
        value = int(m.group(1)) * _SUFFIX[m.group(2)]
    if value <= 0:
        raise invalid(f"{field} must be > 0, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Integer:
    """An int in ``low..high`` (text from the environment or a flag is converted)."""

    low: int = 1
    high: Optional[int] = None

    def __call__(self, raw: Any, where: str) -> int:
        rule = (f"an int in {self.low}..{self.high}" if self.high is not None
                else f"an int >= {self.low}")
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise invalid(f"{where} must be {rule}, got {raw!r}")
        try:
            value = int(raw)
        except ValueError:
            raise invalid(f"{where} must be {rule}, got {raw!r}") from None
        if value < self.low or (self.high is not None and value > self.high):
            raise invalid(f"{where} must be {rule}, got {raw!r}")
        return value


@dataclasses.dataclass(frozen=True)
class Number:
    """A number in ``low..high`` (``open_low``: ``low`` itself excluded)."""

    low: float = 0.0
    high: Optional[float] = None
    open_low: bool = False

    def __call__(self, raw: Any, where: str) -> float:
        rule = (f"a number in {'(' if self.open_low else ''}{self.low:g}.."
                f"{'' if self.high is None else format(self.high, 'g')}"
                f"{']' if self.open_low and self.high is not None else ''}")
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise invalid(f"{where} must be {rule}, got {raw!r}")
        try:
            value = float(raw)
        except ValueError:
            raise invalid(f"{where} must be {rule}, got {raw!r}") from None
        if value < self.low or (self.open_low and value == self.low) or (
                self.high is not None and value > self.high):
            raise invalid(f"{where} must be {rule}, got {raw!r}")
        return value


@dataclasses.dataclass(frozen=True)
class Size:
    """Bytes, or ``512M`` / ``4G`` (binary units); > 0."""

    def __call__(self, raw: Any, where: str) -> int:
        return parse_bytes(raw, where)


@dataclasses.dataclass(frozen=True)
class Text:
    """A string, non-empty unless ``empty`` (``upper``: made upper-case)."""

    upper: bool = False
    empty: bool = False

    def __call__(self, raw: Any, where: str) -> str:
        if not isinstance(raw, str) or not (raw or self.empty):
            raise invalid(f"{where} must be a {'' if self.empty else 'non-empty '}string, "
                          f"got {raw!r}")
        return raw.upper() if self.upper else raw


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``options`` (``fold``: compared and kept in upper or lower case)."""

    options: tuple[str, ...]
    fold: Optional[str] = None  # "upper" | "lower" | None

    def __call__(self, raw: Any, where: str) -> str:
        text = raw.strip() if isinstance(raw, str) else raw
        if isinstance(text, str) and self.fold == "upper":
            text = text.upper()
        elif isinstance(text, str) and self.fold == "lower":
            text = text.lower()
        if text not in self.options:
            raise invalid(f"{where} must be one of {', '.join(self.options)}, got {raw!r}")
        return str(text)


@dataclasses.dataclass(frozen=True)
class Boolean:
    """true or false (text: ``1 true yes on`` / ``0 false no off``)."""

    def __call__(self, raw: Any, where: str) -> bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower() if isinstance(raw, (str, int)) else ""
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise invalid(f"{where} must be true or false (1 or 0), got {raw!r}")


# ----------------------------------------------------------------- declarations

@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything about one setting but its value (see the module docstring)."""

    doc: str
    parse: Optional[Parse]
    #: the key in a file's table / an engine's extra config; None: not there
    key: Optional[str]
    #: environment variables, the first set one wins (``{prefix}`` filled by the layer)
    env: tuple[str, ...] = ()
    #: ``--flag``; None: no flag
    flag: Optional[str] = None
    #: argparse's dest of the flag (default: the flag without dashes)
    dest: Optional[str] = None
    #: the default as the docs and ``--help`` show it (default: the field's default)
    shown: Optional[str] = None
    metavar: Optional[str] = None
    #: a nested configuration (``[disk]``); None for a scalar or a table
    section: Optional[type] = None
    #: a section that is None unless one of its settings is given
    optional: bool = False
    #: ``ID = VALUE`` pairs; ``parse`` parses each value, ``check_key`` each ID
    pairs: bool = False
    check_key: Optional[Callable[[str, str], None]] = None

    @property
    def flag_dest(self) -> Optional[str]:
        if self.flag is None:
            return None
        return self.dest or self.flag.lstrip("-").replace("-", "_")


_SAME = "\0same"


def _field(meta: Setting, default: Any, default_factory: Any, repr: bool) -> Any:
    kw: dict[str, Any] = {"metadata": {_META: meta}, "repr": repr}
    if default_factory is not dataclasses.MISSING:
        kw["default_factory"] = default_factory
    elif default is not dataclasses.MISSING:
        kw["default"] = default
    return dataclasses.field(**kw)


def setting(doc: str, parse: Parse, *, default: Any = dataclasses.MISSING,
            default_factory: Any = dataclasses.MISSING, key: Optional[str] = _SAME,
            env: Union[str, Sequence[str]] = (), flag: Optional[str] = None,
            dest: Optional[str] = None, shown: Optional[str] = None,
            metavar: Optional[str] = None, repr: bool = True) -> Any:
    """A scalar setting (``key`` defaults to the field's name: see :func:`declared`)."""
    envs = (env,) if isinstance(env, str) else tuple(env)
    return _field(Setting(doc, parse, key, envs, flag, dest, shown, metavar), default,
                  default_factory, repr)


def section(doc: str, cls: type, *, key: str, optional: bool = False,
            pairs_flag: Optional[str] = None, metavar: str = "NAME=VALUE") -> Any:
    """A nested configuration under ``[key]``; ``pairs_flag`` (``--limit NAME=VALUE``,
    repeatable) sets its settings by name. Optional: None unless something is given."""
    meta = Setting(doc, None, key, flag=pairs_flag, metavar=metavar, section=cls,
                   optional=optional)
    return _field(meta, None if optional else dataclasses.MISSING,
                  dataclasses.MISSING if optional else cls, True)


def table(doc: str, parse: Parse, *, key: str, check_key: Optional[Callable[[str, str], None]]
          = None, pairs_flag: Optional[str] = None, metavar: str = "ID=VALUE",
          shown: str = "-") -> Any:
    """``[key]`` of ``ID = VALUE`` pairs (and ``pairs_flag ID=VALUE``, repeatable)."""
    meta = Setting(doc, parse, key, flag=pairs_flag, metavar=metavar, shown=shown,
                   pairs=True, check_key=check_key)
    return _field(meta, dataclasses.MISSING, dict, True)


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """The declared fields of ``cls`` (undeclared fields are not settings), with their
    declaration (``key`` resolved to the field name where it said so)."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        if meta.key == _SAME:
            meta = dataclasses.replace(meta, key=f.name)
        yield f, meta


# ----------------------------------------------------------------------- layers

@dataclasses.dataclass(frozen=True)
class Layer:
    """One source of values (see the module docstring)."""

    kind: str  # "table" | "env" | "flags"
    values: Mapping[str, Any]
    #: a table's name in messages (its file, ``kv_connector_extra_config``); env: prefix
    name: str = ""
    #: a table's keys that belong to someone else (passed over, never refused)
    passed: frozenset[str] = frozenset()
    #: a table's values are named ``name['key']`` in messages (else ``key``)
    quoted: bool = False

    @classmethod
    def table(cls, values: Mapping[str, Any], name: str = "",
              passed: frozenset[str] = frozenset(), quoted: bool = False) -> "Layer":
        return cls("table", values, name, passed, quoted)

    @classmethod
    def environ(cls, env: Mapping[str, str], prefix: str = "") -> "Layer":
        return cls("env", env, prefix)

    @classmethod
    def flags(cls, values: Mapping[str, Any]) -> "Layer":
        return cls("flags", values)

    def where(self, path: str) -> str:
        return f"{self.name}[{path!r}]" if self.kind == "table" and self.quoted else path


def env_names(meta: Setting, prefix: str = "") -> tuple[str, ...]:
    """The variables of ``meta`` with ``{prefix}`` filled in (a name that needs a
    prefix has none where the prefix is empty)."""
    return tuple(v.format(prefix=prefix) for v in meta.env if prefix or "{prefix}" not in v)


def _pairs(items: Any, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep:
            raise invalid(f"{flag} takes NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _scope(layers: Sequence[Layer], meta: Setting, path: str) -> list[Layer]:
    """The layers of a section: its table in each table layer (a pairs flag becomes a
    table layer of its own, the last); the environment and the flags stay whole."""
    out: list[Layer] = []
    for layer in layers:
        if layer.kind == "table":
            sub = layer.values.get(meta.key, {}) if meta.key else {}
            if not isinstance(sub, Mapping):
                raise invalid(f"{layer.where(path)} must be a table ({meta.doc})")
            out.append(Layer.table(sub, layer.name, frozenset(), layer.quoted))
        else:
            out.append(layer)
            if layer.kind == "flags" and meta.flag is not None:
                out.append(Layer.table(_pairs(layer.values.get(meta.flag_dest or ""),
                                              meta.flag), "", frozenset()))
    return out


def _gather(cls: type, layers: Sequence[Layer], prefix: str) -> tuple[dict[str, Any], bool]:
    """The keyword arguments of ``cls`` from ``layers``, and whether any was given."""
    decls = list(declared(cls))
    known = sorted(m.key for _, m in decls if m.key)
    for layer in layers:
        if layer.kind != "table":
            continue
        unknown = sorted(set(layer.values) - set(known) - layer.passed)
        if unknown:
            label = prefix.rstrip(".") or layer.name or "config"
            raise invalid(f"{label}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(known)}")
    kw: dict[str, Any] = {}
    given = False
    missing: list[Setting] = []
    for f, meta in decls:
        path = prefix + (meta.key or f.name)
        if meta.section is not None:
            sub, sub_given = _gather(meta.section, _scope(layers, meta, path), path + ".")
            given = given or sub_given
            if sub_given or not meta.optional:
                kw[f.name] = meta.section(**sub)
            continue
        if meta.pairs:
            merged: dict[str, Any] = {}
            for layer in layers:
                if layer.kind == "table" and meta.key is not None and meta.key in layer.values:
                    items = layer.values[meta.key]
                    if not isinstance(items, Mapping):
                        raise invalid(f"{layer.where(path)} must be a table of ID = value")
                    merged.update(items)
                elif layer.kind == "flags" and meta.flag is not None:
                    merged.update(_pairs(layer.values.get(meta.flag_dest or ""), meta.flag))
            if merged:
                kw[f.name] = _parse_pairs(meta, merged, path)
                given = True
            continue
        found: Optional[tuple[Any, str]] = None
        for layer in layers:
            if layer.kind == "table" and meta.key is not None and meta.key in layer.values:
                if layer.values[meta.key] is None and f.default is None:
                    kw[f.name] = None  # the declared "off", said explicitly
                    found = None
                    continue
                found = (layer.values[meta.key], layer.where(path))
            elif layer.kind == "env":
                for var in env_names(meta, layer.name):
                    text = layer.values.get(var)
                    if text is not None and text.strip():
                        found = (text.strip(), var)
                        break
            elif layer.kind == "flags" and meta.flag is not None:
                value = layer.values.get(meta.flag_dest or "")
                if value is not None:  # named by its key, as in the file
                    found = (value, path)
        if found is not None:
            assert meta.parse is not None
            kw[f.name] = meta.parse(found[0], found[1])
            given = True
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(meta)
    given = given or any(layer.kind == "table" and layer.values for layer in layers)
    if missing and given:  # (not given: an optional section nobody asked for)
        meta = missing[0]
        how = " or ".join([*(f"{meta.flag} {meta.metavar or 'VALUE'}",)
                           * (meta.flag is not None), *env_names(meta)])
        raise invalid(f"{prefix.rstrip('.') or 'config'} needs {meta.key}"
                      f"{f' ({how})' if how else ''}: {meta.doc}")
    return kw, given


def _parse_pairs(meta: Setting, items: Mapping[Any, Any], path: str) -> dict[str, Any]:
    assert meta.parse is not None
    out: dict[str, Any] = {}
    for ident, raw in items.items():
        if meta.check_key is not None:
            meta.check_key(str(ident), path)
        out[str(ident)] = meta.parse(raw, f"{path}.{ident}")
    return out


def load(cls: type[_T], layers: Sequence[Layer]) -> _T:
    """``cls`` from its defaults and ``layers`` (a later layer wins)."""
    kw, _ = _gather(cls, layers, "")
    return cls(**kw)


def check_fields(obj: Any, prefix: str = "") -> None:
    """Run every declared field's parser on its value (from ``__post_init__``): a bad
    value is refused as it would be from a file, and the value kept is the parsed one
    (``"info"`` -> ``"INFO"``). None is a declared "off" and passes."""
    for f, meta in declared(type(obj)):
        value = getattr(obj, f.name)
        if value is None or meta.section is not None or meta.parse is None:
            continue
        path = prefix + (meta.key or f.name)
        if meta.pairs:
            if not isinstance(value, Mapping):
                raise invalid(f"{path} must be a table of ID = value, got {value!r}")
            parsed: Any = _parse_pairs(meta, value, path)
        else:
            parsed = meta.parse(value, path)
        if parsed != value or type(parsed) is not type(value):
            object.__setattr__(obj, f.name, parsed)


# ------------------------------------------------------------------ flags, docs

def _shown(f: dataclasses.Field[Any], meta: Setting) -> str:
    if meta.shown is not None:
        return meta.shown
    if f.default is dataclasses.MISSING:
        return "-"
    value = f.default
    if value is None:
        return "off"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and isinstance(meta.parse, Size):
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One option per declared flag of ``cls`` (and of its sections)."""
    for f, meta in declared(cls):
        if meta.section is not None:
            add_flags(parser, meta.section, prefix)
        if meta.flag is None:
            continue
        envs = env_names(meta, prefix)
        tail = "; ".join([*(f"default {_shown(f, meta)}",) * (meta.section is None),
                          *(f"env {e}" for e in envs)])
        help_text = f"{meta.doc} ({tail})" if tail else meta.doc
        if meta.section is not None or meta.pairs:
            parser.add_argument(meta.flag, dest=meta.flag_dest, action="append",
                                metavar=meta.metavar, help=f"{meta.doc} (repeatable)")
        elif isinstance(meta.parse, Boolean):
            parser.add_argument(meta.flag, dest=meta.flag_dest,
                                action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(meta.flag, dest=meta.flag_dest, metavar=meta.metavar,
                                help=help_text.replace("%", "%%"),
                                choices=meta.parse.options
                                if isinstance(meta.parse, Choice) else None)


def flag_names(cls: type) -> set[str]:
    """Every flag ``cls`` declares (with its sections')."""
    out: set[str] = set()
    for _, meta in declared(cls):
        if meta.section is not None:
            out |= flag_names(meta.section)
        if meta.flag is not None:
            out.add(meta.flag)
    return out


def all_env_names(cls: type, prefix: str = "") -> set[str]:
    """Every environment variable ``cls`` declares (with its sections')."""
    out: set[str] = set()
    for _, meta in declared(cls):
        if meta.section is not None:
            out |= all_env_names(meta.section, prefix)
        out |= set(env_names(meta, prefix))
    return out


def _rows(cls: type, key_prefix: str, env_prefix: str, nested: bool
          ) -> Iterator[list[str]]:
    for f, meta in declared(cls):
        if meta.section is not None:
            if meta.flag is not None or not nested:
                flag = f"`{meta.flag} {meta.metavar}`" if meta.flag else "-"
                yield [f"`[{key_prefix}{meta.key}]`", flag, "-", "-", meta.doc]
            if nested:
                yield from _rows(meta.section, f"{key_prefix}{meta.key}.", env_prefix, True)
            continue
        key = (f"`[{key_prefix}{meta.key}]` ID" if meta.pairs else
               f"`{key_prefix}{meta.key}`") if meta.key else "-"
        flag = (f"`{meta.flag} {meta.metavar}`" if meta.pairs else
                "`--[no-]" + meta.flag[2:] + "`" if isinstance(meta.parse, Boolean)
                else f"`{meta.flag} {meta.metavar}`" if meta.metavar
                else f"`{meta.flag} {'|'.join(meta.parse.options)}`"
                if isinstance(meta.parse, Choice) else f"`{meta.flag}`") if meta.flag else "-"
        envs = ", ".join(f"`{e}`" for e in env_names(meta, env_prefix)) or "-"
        shown = _shown(f, meta)
        shown = shown if shown == "-" or meta.shown is not None else f"`{shown}`"
        yield [key, flag.replace("|", "\\|"), envs, shown, meta.doc.replace("|", "\\|")]


def markdown_table(cls: type, *, key_heading: str = "file key", key_prefix: str = "",
                   env_prefix: str = "", nested: bool = True) -> str:
    """The settings of ``cls`` as a Markdown table (the docs' generated blocks): one
    row per declared setting (``nested``: also those of its sections, with dotted
    keys); a column that no setting of ``cls`` fills is left out."""
    heads = [key_heading, "flag", "environment", "default", "what"]
    rows = list(_rows(cls, key_prefix, env_prefix, nested))
    keep = [i for i in range(len(heads)) if i >= 3 or any(r[i] != "-" for r in rows)]
    lines = ["| " + " | ".join(heads[i] for i in keep) + " |",
             "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    return "\n".join(lines)
