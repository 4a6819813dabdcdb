"""The metrics schema (one line of ``RUN_DIR/<site>/metrics.jsonl`` is one dataclass) and
its one reader.

A site's ``dtrain worker`` appends a :class:`StartLine` when it starts, one
:class:`RoundLine` per round attempt and an :class:`EndLine` when it exits cleanly, and
writes a :class:`Summary` to ``summary.json``. ``docs/METRICS.md`` defines every field;
each time (``*_s``) and byte (``bytes_*``) field has one meaning in the lines, the
summary, ``dtrain report`` and ``dtrain launch``.

Versions: every line and summary carries ``version`` (:data:`METRICS_VERSION`). A line
without one is version 1 (before this module; its ``total_s`` is read as ``round_s``).
A field may be added without a new version (readers ignore fields they do not know);
renaming or removing a field or changing its meaning takes a new version. Versions this
dtrain does not know are refused with :class:`MetricsVersionError`.

Reading (:func:`read_metrics`, :class:`MetricsTail`): only complete lines count (a last
line without its newline is being written and is skipped); malformed lines are skipped
with a warning naming the file and line. Used by ``dtrain launch`` (live view, final
table), ``dtrain report``, the experiments and the tests.

No torch import here: ``dtrain report`` and ``dtrain launch`` stay fast to start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Iterable, Literal, Union

__all__ = [
    "METRICS_VERSION",
    "SUPPORTED_VERSIONS",
    "ENGINE_FIELDS",
    "MetricsError",
    "MetricsVersionError",
    "StartLine",
    "RoundLine",
    "EndLine",
    "Line",
    "Summary",
    "Totals",
    "engine_fields",
    "parse_line",
    "complete_lines",
    "read_json_lines",
    "read_metrics",
    "read_summary",
    "write_line",
    "MetricsTail",
    "rejected_applied",
    "chunk_senders",
]

log = logging.getLogger(__name__)

#: The version this dtrain writes.
METRICS_VERSION = 2
#: The versions this dtrain reads (1: lines written before lines had a version).
SUPPORTED_VERSIONS = (1, 2)
#: Version-1 names -> version-2 names.
_V1_RENAMES = {"total_s": "round_s"}
#: RoundResult attributes a round line does not carry (the per-bucket outcome list: its
#: counts are ``bucket_outcomes``; round and members are the line's own fields; the
#: bucket list of a fragment round: its ``fragment`` says which).
_NOT_IN_LINE = ("round", "members", "bucket_outcome", "buckets")
#: RoundResult attribute -> RoundLine field, where the names differ.
_ENGINE_RENAMES = {"total_s": "round_s"}


class MetricsError(ValueError):
    """A metrics line or summary that cannot be used (the message names the field)."""


class MetricsVersionError(MetricsError):
    """A metrics line or summary of a version this dtrain does not read."""


class _Record:
    """What lines and summaries share: their JSON object."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON object (``event`` first; engine fields that are None left out)."""
        d: dict[str, Any] = {"event": self.event} if hasattr(self, "event") else {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and isinstance(self, RoundLine) and (f.name in ENGINE_FIELDS or f.name == "datagram"):
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


@dataclass(frozen=True, kw_only=True)
class StartLine(_Record):
    """First line of a site process: ``round`` is the round it starts at (>0 after a resume)."""

    event: ClassVar[str] = "start"
    version: int = METRICS_VERSION
    site: str = ""
    round: int = 0
    val_loss: float | None = None  # nats/token, of θ before the first round
    wall_s: float = 0.0
    params: int | None = None
    time: float | None = None  # Unix time, s


@dataclass(frozen=True, kw_only=True)
class RoundLine(_Record):
    """One round attempt of one site (``docs/METRICS.md`` defines every field).

    ``status``: a ``dtrain.rounds.outcome.RoundStatus`` value: ``applied`` (a round ran
    here), ``resynced`` (state pulled instead), ``skipped`` (a site group's ranks disagreed:
    slices pulled again) or ``deferred`` (rendezvous unreachable). The engine fields (:data:`ENGINE_FIELDS`,
    from ``RoundResult``) are None, and left out of the JSON, unless a round ran here.
    """

    event: ClassVar[str] = "round"
    version: int = METRICS_VERSION
    site: str = ""
    round: int = 0
    status: Literal["applied", "resynced", "skipped", "deferred"] = "applied"
    reason: str = ""
    members: list[str] = field(default_factory=list)
    val_loss: float | None = None
    train_loss: float | None = None
    inner_steps: int | None = None
    round_steps: int | None = None  # inner steps this site trained in this round's inner phase
    tokens_per_s: float | None = None  # tokens_per_step x round_steps / inner_s: this site's speed
    inner_s: float | None = None
    sync_s: float | None = None
    quorum_s: float | None = None
    cpu_s: float | None = None  # the process's CPU seconds since the previous line (every thread)
    sync_cpu_s: float | None = None  # of which during sync_s (blocking rounds only)
    sync_system_cpu_s: float | None = None  # of sync_cpu_s, in the kernel (system time)
    wall_s: float | None = None
    time: float | None = None
    checksum: str | None = None
    outer_checksum: str | None = None
    datagram: dict[str, Any] | None = None  # the datagram path's cumulative counters (absent on gRPC)

    data: dict | None = None  # the data ledger of the round's inner steps (docs/METRICS.md)
    # ---- engine fields (RoundResult), None when no round ran at this site
    owned_buckets: int | None = None
    applied_buckets: int | None = None
    stale_buckets: int | None = None
    repaired_buckets: int | None = None
    skipped_buckets: int | None = None
    contributed: bool | None = None
    reduce_arrived_fraction: float | None = None
    reduce_live_fraction: float | None = None
    broadcast_arrived_fraction: float | None = None
    included_fraction: float | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None
    encode_s: float | None = None
    encoded_bytes: int | None = None
    encoded_fp32_bytes: int | None = None
    decode_s: float | None = None
    network_s: float | None = None
    wait_s: float | None = None
    round_s: float | None = None
    reduce_s: float | None = None
    means_s: float | None = None
    reduce_timeout_s: float | None = None
    broadcast_timeout_s: float | None = None
    deadline_reason: str | None = None
    rejected: dict[str, int] | None = None
    rejected_examples: dict[str, list[str]] | None = None
    lost_members: list[str] | None = None
    calls_given_up: int | None = None
    late_means: int | None = None
    errors: list[str] | None = None
    fragment: int | None = None
    bucket_outcomes: dict[str, int] | None = None
    rejected_senders: list[dict] | None = None
    mean_senders: dict[str, Any] | None = None
    tokens: int | None = None
    claims: dict[str, int] | None = None
    weight_refused: dict[str, str] | None = None
    trimmed: dict[str, int] | None = None


#: RoundLine fields that come from the round engine's RoundResult (absent unless applied).
_ROUND_NAMES = [f.name for f in dataclasses.fields(RoundLine)]
ENGINE_FIELDS = tuple(_ROUND_NAMES[_ROUND_NAMES.index("owned_buckets") :])


@dataclass(frozen=True, kw_only=True)
class EndLine(_Record):
    """Last line of a site process that exited cleanly (after ``linger_s``).

    ``bytes_sent``/``bytes_received``: what the transport counted after the last round
    line (an owner serving its last means to peers that pull them after its round ended),
    so that the lines of a process add up to its transport's totals.
    """

    event: ClassVar[str] = "end"
    version: int = METRICS_VERSION
    site: str = ""
    round: int = 0  # rounds this site has completed
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float | None = None
    time: float | None = None


Line = Union[StartLine, RoundLine, EndLine]
_LINE_TYPES: dict[str, type] = {c.event: c for c in (StartLine, RoundLine, EndLine)}


@dataclass(frozen=True, kw_only=True)
class Summary(_Record):
    """``summary.json`` of one site process (totals over its lines since it started)."""

    version: int = METRICS_VERSION
    site: str = ""
    rounds: int = 0  # rounds completed (the next round number)
    first_val_loss: float | None = None
    final_val_loss: float | None = None
    final_train_loss: float | None = None
    checksum: str | None = None
    wall_s: float = 0.0
    inner_s: float = 0.0
    sync_s: float = 0.0
    quorum_s: float = 0.0
    round_s: float = 0.0
    sync_share: float = 0.0  # sync_s / wall_s
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds_joined: int = 0
    encoded_bytes: int = 0
    encoded_fp32_bytes: int = 0
    fp32_bytes_per_round: int | None = None
    compression_ratio: float | None = None  # encoded_fp32_bytes / encoded_bytes
    owned_buckets: int | None = None  # buckets this site owned in the last round it ran
    num_buckets: int | None = None  # buckets of θ (the layout, fixed for the run)
    interrupted: bool = False


def engine_fields(result: Any) -> dict[str, Any]:
    """The :data:`ENGINE_FIELDS` of a ``dtrain.rounds.RoundResult`` (``total_s`` -> ``round_s``).

    Raises:
        MetricsError: the result has an attribute the schema does not define (a new
            RoundResult field needs a RoundLine field and a line in docs/METRICS.md).
    """
    out = {}
    for f in dataclasses.fields(result):
        if f.name in _NOT_IN_LINE:
            continue
        name = _ENGINE_RENAMES.get(f.name, f.name)
        if name not in ENGINE_FIELDS:
            raise MetricsError(f"RoundResult.{f.name} has no RoundLine field; add it to dtrain.metrics and METRICS.md")
        v = getattr(result, f.name)
        out[name] = dict(v) if isinstance(v, dict) else (list(v) if isinstance(v, (list, tuple)) else v)
    return out


def _version_of(obj: dict, where: str) -> int:
    v = obj.get("version", 1)
    if isinstance(v, bool) or v not in SUPPORTED_VERSIONS:
        raise MetricsVersionError(
            f"{where}: metrics version {v!r} is not one this dtrain reads "
            f"(versions {', '.join(map(str, SUPPORTED_VERSIONS))}; see docs/METRICS.md); "
            "read it with the dtrain that wrote it"
        )
    return v


def _build(cls: type, obj: dict, version: int) -> Any:
    if version == 1:
        obj = {_V1_RENAMES.get(k, k): v for k, v in obj.items()}
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in obj.items() if k in names and k != "version"})


def parse_line(obj: Any, where: str = "metrics line") -> Line:
    """A :data:`Line` from one decoded JSON line.

    Raises:
        MetricsVersionError: an unknown ``version``.
        MetricsError: not an object, an unknown ``event``, a non-integer ``round``.
    """
    if not isinstance(obj, dict):
        raise MetricsError(f"expected a JSON object, got {type(obj).__name__}")
    version = _version_of(obj, where)
    cls = _LINE_TYPES.get(obj.get("event"))  # type: ignore[arg-type]
    if cls is None:
        raise MetricsError(f"'event' must be one of {', '.join(_LINE_TYPES)}, got {obj.get('event')!r}")
    r = obj.get("round")
    if isinstance(r, bool) or not isinstance(r, int):
        raise MetricsError(f"'round' must be an integer, got {r!r}")
    return _build(cls, obj, version)


def complete_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) of every complete non-blank line of ``text``; a last
    piece without its newline (a line being written) is left out."""
    pieces = text.split("\n")[:-1]
    return [(i, ln) for i, ln in enumerate(pieces, start=1) if ln.strip()]


def read_json_lines(path: str | Path) -> list[dict]:
    """The JSON objects of a JSON-lines file's complete lines (any schema; malformed lines
    skipped with a warning; ``[]`` when the file cannot be read)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for lineno, raw in complete_lines(text):
        try:
            obj = json.loads(raw)
        except ValueError as e:
            log.warning("%s:%d: skipping malformed line (%s)", path, lineno, e)
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _parse_text(text: str, path: str | Path, first_lineno: int = 1) -> list[Line]:
    out: list[Line] = []
    for lineno, raw in complete_lines(text):
        where = f"{path}:{lineno + first_lineno - 1}"
        try:
            out.append(parse_line(json.loads(raw), where))
        except MetricsVersionError:
            raise
        except (ValueError, TypeError) as e:
            log.warning("%s: skipping malformed metrics line (%s)", where, e)
    return out


def read_metrics(path: str | Path) -> list[Line]:
    """Every complete line of a ``metrics.jsonl`` as a :data:`Line`, in file order.

    Returns ``[]`` when the file cannot be read. Malformed lines are skipped with a
    warning ``PATH:LINE: skipping malformed metrics line (why)``.

    Raises:
        MetricsVersionError: a line of a version this dtrain does not read (the message
            names the file and line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return _parse_text(text, path)


def read_summary(path: str | Path) -> Summary | None:
    """A site's ``summary.json``; None when absent or unreadable (a warning says why).

    Raises:
        MetricsVersionError: a summary of a version this dtrain does not read.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable summary (%s), ignoring it", path, e)
        return None
    if not isinstance(obj, dict):
        log.warning("%s: expected a JSON object, ignoring it", path)
        return None
    try:
        return _build(Summary, obj, _version_of(obj, str(path)))
    except TypeError as e:
        log.warning("%s: unusable summary (%s), ignoring it", path, e)
        return None


def write_line(f: IO[str], line: Line) -> None:
    """Append ``line`` as one JSON line to the open text file ``f`` and flush it."""
    f.write(json.dumps(line.as_dict()) + "\n")
    f.flush()


class MetricsTail:
    """Reads a ``metrics.jsonl`` that is still being written, one poll at a time.

    Args:
        path: the file (it may not exist yet).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._pos = 0  # bytes of complete lines consumed
        self._lineno = 1

    def poll(self) -> list[Line]:
        """The lines completed since the last poll (a half-written last line waits for its
        newline). Raises :class:`MetricsVersionError` like :func:`read_metrics`."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        if end == 0:
            return []
        text = chunk[:end].decode("utf-8", errors="replace")
        self._pos += end
        lines = _parse_text(text, self.path, self._lineno)
        self._lineno += text.count("\n")
        return lines


@dataclass
class Totals:
    """Sums of a site's lines: the time fields over round lines, the byte and codec fields
    over round lines that ran a round and end lines. ``Summary`` fields of the same names."""

    inner_s: float = 0.0
    sync_s: float = 0.0
    quorum_s: float = 0.0
    round_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    encoded_bytes: int = 0
    encoded_fp32_bytes: int = 0
    rounds_joined: int = 0

    def add(self, line: Line) -> None:
        """Count one line (start lines add nothing)."""
        if isinstance(line, EndLine):
            self.bytes_sent += line.bytes_sent
            self.bytes_received += line.bytes_received
            return
        if not isinstance(line, RoundLine):
            return
        for name in ("inner_s", "sync_s", "quorum_s", "round_s"):
            v = getattr(line, name)
            if isinstance(v, (int, float)) and math.isfinite(v):
                setattr(self, name, getattr(self, name) + v)
        if line.round_s is None and line.bytes_sent is None:
            return  # no round ran at this site
        self.rounds_joined += 1
        for name in ("bytes_sent", "bytes_received", "encoded_bytes", "encoded_fp32_bytes"):
            v = getattr(line, name)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(self, name, getattr(self, name) + v)

    @property
    def compression_ratio(self) -> float | None:
        """fp32 bytes of what this site encoded / its encoded bytes (None if it encoded nothing)."""
        return self.encoded_fp32_bytes / self.encoded_bytes if self.encoded_bytes else None


def rejected_applied(lines: Iterable[dict]) -> list[str]:
    """Round lines (dicts, of any sites) -> one reason per case where something an owner
    refused reached a mean a site applied (empty: nothing refused was applied).

    For each ``rejected_senders`` entry of owner O in round r (bucket b, chunk c, sender
    s): the mean O finalized must not have counted the refused payload (``counted`` equal
    to ``digest``), and when it counted nothing from s (``counted`` None), no site's
    applied line of round r may list s among the senders of b's chunk c
    (``mean_senders``). A spoofed name whose owner also got the real sender's payload is
    fine: ``counted`` is then another digest. Lines without the fields (version 2 lines
    before they existed, or not ``applied``) are skipped.
    """
    applied: dict[int, list[dict]] = {}
    refusals: list[tuple[int, str, dict]] = []
    for ln in lines:
        if ln.get("event", "round") != "round" or ln.get("status") != "applied":
            continue
        applied.setdefault(ln["round"], []).append(ln)
        refusals.extend((ln["round"], ln.get("site", ""), e) for e in ln.get("rejected_senders") or [])
    out = []
    for r, owner, e in refusals:
        b, c, s = e["bucket"], e["chunk"], e["sender"]
        what = f"round {r}: {owner} refused {s}'s b{b} c{c} ({e.get('digest')})"
        if e.get("counted") is not None and e.get("counted") == e.get("digest"):
            out.append(f"{what} but its mean counted that payload")
        if e.get("counted") is not None:
            continue
        for ln in applied.get(r, []):
            entry = (ln.get("mean_senders") or {}).get(str(b))
            if s in chunk_senders(entry, c):
                out.append(f"{what} but {ln.get('site')} applied a mean of it that includes {s}")
    return out


def chunk_senders(entry: Any, chunk: int) -> list[str]:
    """The senders of chunk ``chunk`` in a ``mean_senders`` entry of a metrics line: the compact
    form (``{"senders", "absent"}``, :func:`dtrain.rounds.types.compact_senders`) or the list per
    chunk that lines before it held; [] for no entry or a chunk past its end."""
    if not entry:
        return []
    if isinstance(entry, dict):
        absent = entry.get("absent") or {}
        return [s for s in entry.get("senders", []) if chunk not in absent.get(s, ())]
    return list(entry[chunk]) if 0 <= chunk < len(entry) else []
