"""Config trees as command lines and TOML files, and back.

A *config tree* is a frozen dataclass whose fields are scalars (the *leaves*: ``int``,
``float``, ``str``, ``bool``, a ``Literal`` of strings, :class:`HostPort`, each optionally
``| None``) or other such dataclasses (the *nodes*). :class:`Tree` walks one and gives
every leaf

* a dotted key, its path from the root: ``diloco.rounds.aggregation.trim_fraction``;
* a flag, the key with dashes: ``--diloco.rounds.aggregation.trim-fraction``
  (booleans: ``--x`` / ``--no-x``, everywhere);
* a TOML key, the same path as tables: ``[diloco.rounds.aggregation]`` ``trim_fraction = 0.1``;
* one line of ``--help`` from the declaring class's Google-style ``Attributes:`` section
  (:func:`field_docs`), with its unit (from the name's suffix, :func:`unit_of`), its
  allowed values and its default;

and optional short *aliases* (``--sync-every``, flat TOML ``sync_every = 500``). Values
are checked by the config classes themselves (their ``__post_init__`` raises ValueError
naming the field and the allowed values); a parse or type error is a :class:`UsageError`
naming the flag or TOML key. :meth:`Tree.to_argv` turns values back into flags for a
child process. Nothing here imports torch or grpc: the command line parses and checks
its arguments before anything heavy is loaded.

Standard library only (argparse, tomllib; tomli on Python 3.10).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping

__all__ = [
    "HostPort",
    "Leaf",
    "Node",
    "Tree",
    "UsageError",
    "field_docs",
    "load_toml",
    "unit_of",
]


class UsageError(Exception):
    """A bad flag or config value; the command line prints it as one line, exit code 2."""


# ------------------------------------------------------------------ host:port
@dataclass(frozen=True, order=True)
class HostPort:
    """A TCP address: ``host`` (a name, IPv4, or IPv6 without brackets) and ``port`` (0 = any free).

    The one parser of ``host:port`` text in dtrain (:meth:`parse`); ``str()`` gives it back
    (IPv6 in brackets: ``[::1]:80``).
    """

    host: str
    port: int

    @classmethod
    def parse(cls, text: object, name: str = "address") -> HostPort:
        """``"host:port"`` (port 0..65535; ``[v6]:port`` for IPv6) as a HostPort.

        Raises:
            ValueError: naming ``name`` and the expected form.
        """
        if isinstance(text, HostPort):
            return text
        host, _, port = str(text).rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not isinstance(text, str) or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{name} must be host:port with port in [0, 65535], got {text!r}")
        return cls(host, int(port))

    @classmethod
    def coerce(cls, value: object, name: str) -> HostPort | None:
        """None stays None; a HostPort stays; text is parsed (for config ``__post_init__``)."""
        return None if value is None else cls.parse(value, name)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# ------------------------------------------------------------------ field docs
_ENTRY = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s*:\s*(.*)$")
_ROLE = re.compile(r":(?:class|data|meth|func|attr|mod):`~?([^`]+)`")


def _plain(text: str) -> str:
    """RST markup removed: ``x`` -> x, :class:`a.B` -> a.B."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its one-line text from ``cls``'s Google-style ``Attributes:`` section.

    An entry is ``name: text`` (or ``a, b: text`` for several fields) indented under the
    header; more-indented lines continue it. The text is joined into one line with RST
    markup removed.
    """
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Attributes:")
    except StopIteration:
        return out
    base = len(lines[start]) - len(lines[start].lstrip())
    names: list[str] = []
    entry_indent = None
    for ln in lines[start + 1 :]:
        if not ln.strip():
            continue
        indent = len(ln) - len(ln.lstrip())
        if indent <= base:
            break  # the next section (Raises:, ...)
        m = _ENTRY.match(ln.strip())
        if m and (entry_indent is None or indent <= entry_indent):
            entry_indent = indent
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
        else:
            for n in names:
                out[n] = (out[n] + " " + ln.strip()).strip()
    return {k: _plain(v) for k, v in out.items()}


_UNITS = (
    ("_s", "seconds"),
    ("_ms", "milliseconds"),
    ("_bytes", "bytes"),
    ("_mbit", "Mbit/s"),
    ("_fraction", "fraction"),
)


def unit_of(name: str) -> str | None:
    """The unit a field name's suffix declares (``quorum_wait_s`` -> ``seconds``), or None."""
    return next((unit for suffix, unit in _UNITS if name.endswith(suffix)), None)


# ------------------------------------------------------------------ the tree
_SCALARS = (bool, int, float, str, HostPort)


@dataclass(frozen=True)
class Node:
    """A dataclass field holding another config (a TOML table, a ``--help`` group)."""

    path: str  # dotted field path from the root ("" for the root itself)
    key: str  # dotted key of its flags and TOML table ("" for a flattened node)
    cls: type
    optional: bool  # ``X | None``: built only when one of its leaves is given
    doc: str


@dataclass(frozen=True)
class Leaf:
    """One settable option.

    Attributes:
        path: dotted field path from the root (what :meth:`Tree.build` takes).
        key: dotted name of the flag and TOML key (== path unless a node is flattened).
        kind: bool, int, float, str or HostPort.
        choices: the allowed strings of a ``Literal`` (else None).
        optional: the field accepts None (``none`` or ``off`` on the command line).
        default: the tree's default value.
        doc: one line of help (from the declaring class's docstring).
        owner: the declaring class.
    """

    path: str
    key: str
    kind: type
    choices: tuple[str, ...] | None
    optional: bool
    default: Any
    doc: str
    owner: type

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def type_name(self) -> str:
        if self.choices:
            return "str"
        return {HostPort: "host:port", float: "number"}.get(self.kind, self.kind.__name__)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        return args[0], True
    return tp, False


class Tree:
    """The options of one config tree.

    Args:
        root: the root dataclass.
        default: the default root instance (its values are every option's default);
            ``root()`` when None.
        hidden: dotted field path -> why it is not an option (a leaf or a whole node),
            e.g. ``{"diloco.hook_optimizer": "fixed by the worker"}``. Hidden fields keep
            their default; a TOML key naming one is refused with that reason.
        aliases: short name -> dotted key (``{"sync_every": "diloco.sync_every"}``): a
            flag ``--sync-every`` and a top-level TOML key ``sync_every``. An alias of a
            hidden field is dropped.
        flatten: dotted field paths of nodes whose leaves take no key prefix (``launch``
            mounts the worker tree at its root).

    Raises:
        TypeError: a field of a type that is not a leaf or node and not hidden.
        ValueError: two options would share a flag.
    """

    def __init__(
        self,
        root: type,
        *,
        default: Any = None,
        hidden: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
        flatten: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        self.default = default if default is not None else root()
        self.hidden = dict(hidden or {})
        self.flatten = flatten
        self.nodes: dict[str, Node] = {}
        self.leaves: dict[str, Leaf] = {}  # by path
        self._walk(root, self.default, "", "")
        self.by_key = {leaf.key: leaf for leaf in self.leaves.values()}
        if len(self.by_key) != len(self.leaves):
            raise ValueError(f"{root.__name__}: two options share a key")
        self.tables = {n.key for n in self.nodes.values() if n.key}
        self.aliases = {a: k for a, k in (aliases or {}).items() if k in self.by_key}
        clash = set(self.aliases) & (set(self.by_key) | self.tables)
        if clash:
            raise ValueError(f"{root.__name__}: aliases {sorted(clash)} clash with option keys")
        # keys a TOML file may name but not set, with the reason
        self.refused = {self._key_of(p): why for p, why in self.hidden.items()}
        self.refused.update({a: self.refused[k] for a, k in (aliases or {}).items() if k in self.refused})

    # ---------------------------------------------------------------- walking
    def _key_of(self, path: str) -> str:
        parts, key = path.split("."), ""
        for i, part in enumerate(parts):
            prefix = ".".join(parts[: i + 1])
            if i < len(parts) - 1 and prefix in self.flatten:
                continue
            key = f"{key}.{part}" if key else part
        return key

    def _walk(self, cls: type, default: Any, path: str, key: str) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            p = f"{path}.{f.name}" if path else f.name
            if p in self.hidden or not f.init:
                continue
            tp, optional = _unwrap(hints[f.name])
            value = getattr(default, f.name)
            doc = docs.get(f.name, "")
            if dataclasses.is_dataclass(tp) and tp not in _SCALARS:
                k = key if p in self.flatten else (f"{key}.{f.name}" if key else f.name)
                self.nodes[p] = Node(p, "" if p in self.flatten else k, tp, optional, doc)
                self._walk(tp, value if value is not None else tp(), p, k if p not in self.flatten else key)
                continue
            choices = None
            if typing.get_origin(tp) is Literal:
                choices, tp = tuple(typing.get_args(tp)), str
            if tp not in _SCALARS or (tp is bool and optional):  # a bool is --x / --no-x: never None
                raise TypeError(f"{cls.__name__}.{f.name}: type {hints[f.name]!r} is not an option type; hide it")
            k = f"{key}.{f.name}" if key else f.name
            self.leaves[p] = Leaf(p, k, tp, choices, optional, value, doc, cls)

    def resolve(self, name: str) -> Leaf:
        """The leaf a dotted path, dotted key or alias names (dashes or underscores).

        Raises:
            KeyError: no such option.
        """
        n = name.replace("-", "_")
        leaf = self.leaves.get(n) or self.by_key.get(n) or self.by_key.get(self.aliases.get(n, ""))
        if leaf is None:
            raise KeyError(name)
        return leaf

    def __iter__(self) -> Iterator[Leaf]:
        return iter(self.leaves.values())

    # ---------------------------------------------------------------- building
    def build(self, values: Mapping[str, Any]) -> Any:
        """The root config with ``values`` (by path, key or alias) over the defaults.

        Hidden fields may be set here by path (the program's own values, e.g. the
        launcher's per-site ones).

        Raises:
            ValueError: from a config class's check (naming the field and allowed values).
            KeyError: an unknown name.
        """
        by_path: dict[str, Any] = {}
        for name, v in values.items():
            n = name.replace("-", "_")
            if self._is_hidden(n):
                by_path[n] = v
            else:
                leaf = self.resolve(n)
                by_path[leaf.path] = self.check_value(leaf, v)
        return self._build(self.root, self.default, "", by_path)

    def _is_hidden(self, path: str) -> bool:
        return any(path == h or path.startswith(h + ".") for h in self.hidden)

    def _build(self, cls: type, default: Any, path: str, values: dict[str, Any]) -> Any:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            p = f"{path}.{f.name}" if path else f.name
            sub = getattr(default, f.name)
            if p in values:
                kwargs[f.name] = values[p]
            elif any(k.startswith(p + ".") for k in values):
                tp, _ = _unwrap(typing.get_type_hints(cls)[f.name])
                kwargs[f.name] = self._build(tp, sub if sub is not None else tp(), p, values)
            else:
                kwargs[f.name] = sub
        try:
            return cls(**kwargs)
        except ValueError as e:  # "rtt_s must be ..." -> "net.datagram.rtt_s must be ...": which one
            field, _, rest = str(e).partition(" ")
            if not path or field not in {f.name for f in dataclasses.fields(cls)}:
                raise
            raise ValueError(f"{path}.{field} {rest}") from e

    # ---------------------------------------------------------------- text in
    def parse_text(self, leaf: Leaf, text: str) -> Any:
        """A flag's text as the leaf's value (ValueError: argparse's "invalid int value").

        Choices and addresses are checked by :meth:`build`, so that a bad one is a
        UsageError like every other bad value.
        """
        if leaf.optional and text.strip().lower() in ("none", "off"):
            return None
        return leaf.kind(text) if leaf.kind in (int, float) else text

    @staticmethod
    def check_value(leaf: Leaf, value: Any) -> Any:
        """``value`` for ``leaf``: a ``Literal``'s choice checked, host:port text parsed.

        Raises:
            ValueError: naming the option and the allowed values.
        """
        if value is None:
            return value
        if leaf.choices is not None and value not in leaf.choices:
            raise ValueError(f"{leaf.key} must be one of {', '.join(leaf.choices)}, got {value!r}")
        if leaf.kind is HostPort:
            return HostPort.parse(value, leaf.name)
        return value

    def from_toml(self, data: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Values (by path) from a parsed TOML document; UsageError naming the bad key."""
        out: dict[str, Any] = {}
        self._toml_table(data, "", source, out)
        return out

    def _toml_table(self, data: Mapping[str, Any], prefix: str, source: str, out: dict[str, Any]) -> None:
        for k, v in data.items():
            name = k.replace("-", "_")
            full = prefix + name
            if isinstance(v, dict) and full in self.tables:
                self._toml_table(v, full + ".", source, out)
                continue
            leaf = self.by_key.get(full) or (self.by_key.get(self.aliases.get(name, "")) if not prefix else None)
            if leaf is None or isinstance(v, dict):
                if full in self.refused:
                    raise UsageError(f"config: {source}: field {k!r} is {self.refused[full]}")
                if full in self.tables:  # a table given a value: name its fields
                    raise UsageError(
                        f"config: {source}: {k!r}{' in [' + prefix[:-1] + ']' if prefix else ''} is a table "
                        f"([{full}]), not a value: set one of its fields ({', '.join(self._allowed_at(full + '.'))})"
                    )
                raise UsageError(
                    f"config: {source}: unknown field {k!r}{' in [' + prefix[:-1] + ']' if prefix else ''} "
                    f"(allowed: {', '.join(self._allowed_at(prefix))})"
                )
            out[leaf.path] = self._toml_value(leaf, name, v, source)

    def _allowed_at(self, prefix: str) -> list[str]:
        names = {k[len(prefix) :].split(".")[0] for k in [*self.by_key, *self.tables] if k.startswith(prefix)}
        if not prefix:
            names |= set(self.aliases)
        return sorted(names)

    def _toml_value(self, leaf: Leaf, name: str, v: Any, source: str) -> Any:
        if v is None and leaf.optional:
            return None
        kind = leaf.kind
        ok = (
            (kind is bool and isinstance(v, bool))
            or (kind is int and isinstance(v, int) and not isinstance(v, bool))
            or (kind is float and isinstance(v, (int, float)) and not isinstance(v, bool))
            or (kind in (str, HostPort) and isinstance(v, str))
        )
        if not ok:
            raise UsageError(f"config: {source}: field {name!r} must be {leaf.type_name}, got {v!r}")
        return float(v) if kind is float else v

    # ---------------------------------------------------------------- argv out
    def to_argv(self, values: Mapping[str, Any]) -> list[str]:
        """Flags that make a child process parse ``values`` (by path, key or alias) again.

        Booleans become ``--x`` / ``--no-x``; None becomes ``none``; a HostPort ``host:port``.
        """
        argv: list[str] = []
        for name, v in values.items():
            leaf = self.resolve(name)
            if leaf.kind is bool and v is not None:
                argv.append(leaf.flag if v else "--no-" + leaf.flag[2:])
            else:
                argv += [leaf.flag, "none" if v is None else str(v)]
        return argv

    def values_from(self, ns: argparse.Namespace) -> dict[str, Any]:
        """The values (by path) of the flags given on a command line built by :meth:`add_to`."""
        return {leaf.path: getattr(ns, _dest(leaf)) for leaf in self if hasattr(ns, _dest(leaf))}

    # ---------------------------------------------------------------- argparse
    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add one flag per leaf (short alias first), in one help group per node."""
        short = {k: a for a, k in self.aliases.items()}
        owners = {leaf.path.rpartition(".")[0] for leaf in self}
        groups = {p: parser.add_argument_group(*self._group_text(p)) for p in ["", *self.nodes] if p in owners}
        for leaf in self:
            owner_path = leaf.path.rpartition(".")[0]
            flags = [leaf.flag]
            if leaf.key in short:
                flags.insert(0, "--" + short[leaf.key].replace("_", "-"))
            # a leaf of an optional node (unset by default) has no default of its own: the
            # node's class default applies only once one of its options is given
            unset = self.nodes[owner_path].optional if owner_path in self.nodes else False
            kw: dict[str, Any] = {
                "dest": _dest(leaf),
                "default": argparse.SUPPRESS,
                "help": help_line(leaf, unset_node=unset),
            }
            if leaf.kind is bool and not leaf.optional:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = _converter(self, leaf)
                kw["metavar"] = _metavar(leaf)
            groups[owner_path].add_argument(*flags, **kw)

    def _group_text(self, node_path: str) -> tuple[str, str]:
        if not node_path:
            return f"{self.root.__name__}", _first_line(self.root)
        node = self.nodes[node_path]
        title = f"{node.key or node_path} ({node.cls.__name__})"
        extra = " Unset by default: giving any of these options sets it." if node.optional else ""
        return title, (node.doc or _first_line(node.cls)) + extra


def _first_line(cls: type) -> str:
    return _plain(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " "))


def _dest(leaf: Leaf) -> str:
    return "opt:" + leaf.path


def _converter(tree: Tree, leaf: Leaf):
    def convert(text: str) -> Any:
        return tree.parse_text(leaf, text)

    convert.__name__ = leaf.type_name  # argparse: "invalid int value: 'x'"
    return convert


def _metavar(leaf: Leaf) -> str:
    if leaf.choices:
        return leaf.name.upper()
    unit = unit_of(leaf.name)
    if unit in ("seconds", "milliseconds", "bytes"):
        return {"seconds": "SECONDS", "milliseconds": "MS", "bytes": "BYTES"}[unit]
    return {int: "INT", float: "NUM", str: "TEXT", HostPort: "HOST:PORT", bool: "BOOL"}[leaf.kind]


def _show(value: Any, name: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return repr(value) if value == "" else value
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024 and value % 1024 == 0:
        for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value % div == 0:
                return f"{value} ({value // div} {unit})"
    return str(value)


def help_line(leaf: Leaf, *, unset_node: bool = False) -> str:
    """``--help`` text: the field's doc, then [unit; allowed values; default].

    ``unset_node``: the leaf belongs to an optional node that is unset by default (e.g.
    ``broadcast_codec``: None = same as ``codec``); the default shown is then the one
    the node takes once any of its options is given."""
    parts = []
    unit = unit_of(leaf.name)
    if unit:
        parts.append(f"unit: {unit}")
    if leaf.choices:
        parts.append("one of: " + ", ".join(leaf.choices) + (", none" if leaf.optional else ""))
    elif leaf.optional:
        parts.append(f"{leaf.type_name} or none")
    if unset_node:
        parts.append(f"default: unset; {_show(leaf.default, leaf.name)} once any option of this group is given")
    else:
        parts.append(f"default: {_show(leaf.default, leaf.name)}")
    return f"{leaf.doc or leaf.name} [{'; '.join(parts)}]".replace("%", "%%")


def load_toml(path: str) -> dict[str, Any]:
    """The parsed TOML file; UsageError naming ``config`` if missing or invalid."""
    try:
        import tomllib  # type: ignore[import-not-found]
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config: file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config: {path} is not valid TOML: {e}") from None
