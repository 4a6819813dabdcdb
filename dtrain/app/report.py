"""`dtrain report RUN_DIR`: plots and a markdown summary of a finished (or partial) run.

Reads every ``RUN_DIR/<site>/metrics.jsonl`` (format: ``docs/METRICS.md``) and the optional
``RUN_DIR/<site>/summary.json``, and writes into ``RUN_DIR``:

- ``val_loss_rounds.png``: validation loss per site over rounds (the ``start`` line at round -1);
- ``val_loss_wall.png``: validation loss per site over wall time;
- ``sync_time.png``: ``sync_s`` per round (mean over the sites that ran the round) as
  ``quorum_s`` + ``round_s`` + the rest (stacked bars), and beside it ``round_s`` with the
  engine's timers ``encode_s`` / ``network_s`` / ``decode_s`` / ``wait_s`` as lines (they
  overlap, so they are not a split of ``round_s``);
- ``bytes.png``: ``bytes_sent`` and ``bytes_received`` of each round's lines, summed over sites;
- ``report.md``: a short summary (per-site table, checksum agreement, faults, rejections).

Every field is the metrics line's field of the same name (``dtrain.metrics``,
``docs/METRICS.md``); the per-site table's ``bytes_sent``/``bytes_received`` add the
``end`` lines (bytes served after a site's last round), so they equal summary.json's.

Which lines count: a ``deferred`` line (the rendezvous was unreachable, θ unchanged) is counted
only in ``num_deferred``; of several non-deferred lines for the same (site, round) — a run
resumed from a checkpoint re-appends to the same file — the last one wins. After a resume
the file holds a second ``start`` line whose ``wall_s`` restarts at 0; wall times after it are
shifted by the last wall time seen before it, so the wall-time axis stays monotone.

Plotting uses matplotlib's Agg canvas directly (``matplotlib.figure.Figure`` +
``FigureCanvasAgg``): no display is needed and the process-wide pyplot backend is left alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.metrics import EndLine, StartLine, read_metrics, read_summary

__all__ = ["make_report", "summarize_run", "load_site_metrics", "SiteMetrics", "REPORT_FILES"]

log = logging.getLogger(__name__)

#: Files :func:`make_report` writes into the run directory, in this order.
REPORT_FILES = ("val_loss_rounds.png", "val_loss_wall.png", "sync_time.png", "bytes.png", "report.md")

_ROUND_PARTS = ("encode_s", "network_s", "decode_s", "wait_s")
_ROUND_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
_SYNC_COLORS = ("#8172b3", "#937860", "#bbbbbb")  # quorum_s, round_s, the rest of sync_s


@dataclass
class SiteMetrics:
    """The parsed metrics of one site.

    Attributes:
        site: site_id (from the lines' ``site`` field, else the directory name).
        path: the metrics.jsonl file.
        start: the first ``start`` line, or None if the file has none.
        rounds: round number -> the line that counts for it (last non-deferred line).
        order: the counted lines in file order, each with ``wall_s`` made monotone across resumes.
        num_deferred: number of ``deferred`` lines.
        num_resumes: number of ``start`` lines after the first.
        ends: the ``end`` lines (one per site process that exited cleanly).
        summary: the parsed summary.json, or None when absent/unreadable.
    """

    site: str
    path: Path
    start: dict | None = None
    rounds: dict[int, dict] = field(default_factory=dict)
    order: list[dict] = field(default_factory=list)
    num_deferred: int = 0
    num_resumes: int = 0
    ends: list[dict] = field(default_factory=list)
    summary: dict | None = None


def _num(value: Any) -> float:
    """A float from a metrics value; NaN for missing or non-numeric values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def load_site_metrics(path: str | Path) -> SiteMetrics:
    """Parse one site's ``metrics.jsonl`` (and the ``summary.json`` beside it, if any).

    Malformed lines (not JSON, not an object, unknown ``event``, non-integer ``round``) are
    skipped with a warning naming the file and the 1-based line number; blank lines and a
    half-written last line are ignored (:func:`dtrain.metrics.read_metrics`).

    Args:
        path: a ``metrics.jsonl`` file.

    Returns:
        The :class:`SiteMetrics`; ``rounds`` is empty if no valid round line was found.

    Raises:
        dtrain.metrics.MetricsVersionError: a line or the summary of a version this dtrain does not read.
    """
    path = Path(path)
    site = SiteMetrics(site=path.parent.name, path=path)
    named = False
    wall_offset = 0.0
    last_wall = 0.0
    for line in read_metrics(path):
        obj = line.as_dict()
        if not named and isinstance(obj.get("site"), str) and obj["site"]:
            site.site, named = obj["site"], True
        if isinstance(line, StartLine):
            if site.start is None:
                site.start = dict(obj, wall_s=0.0)
            else:
                site.num_resumes += 1
                wall_offset = last_wall
            continue
        if isinstance(line, EndLine):
            site.ends.append(obj)
            continue
        if obj.get("status") == "deferred":
            site.num_deferred += 1
            continue
        wall = _num(obj.get("wall_s"))
        if not math.isnan(wall):
            obj["wall_s"] = wall + wall_offset
            last_wall = obj["wall_s"]
        site.rounds[obj["round"]] = obj
        site.order.append(obj)
    summ = read_summary(path.parent / "summary.json")
    site.summary = summ.as_dict() if summ is not None else None
    return site


def _load_run(run_dir: Path) -> list[SiteMetrics]:
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist or is not a directory")
    files = sorted(run_dir.glob("*/metrics.jsonl"))
    sites = [load_site_metrics(p) for p in files]
    sites = [s for s in sites if s.start is not None or s.rounds]
    if not sites:
        raise ValueError(
            f"no metrics in run directory {str(run_dir)!r}: expected <site>/metrics.jsonl files with at least "
            f"one valid line (found {len(files)} metrics file(s))"
        )
    seen: dict[str, Path] = {}
    for s in sites:
        if s.site in seen:
            log.warning(
                "site %r appears in both %s and %s; keeping both, labelled by directory", s.site, seen[s.site], s.path
            )
            s.site = f"{s.site} ({s.path.parent.name})"
        seen[s.site] = s.path
    return sorted(sites, key=lambda s: s.site)


def _site_summary(s: SiteMetrics) -> dict:
    lines = [s.rounds[r] for r in sorted(s.rounds)]
    last = s.order[-1] if s.order else None
    rejected: dict[str, int] = {}
    for ln in lines:
        rej = ln.get("rejected")
        if isinstance(rej, dict):
            for reason, n in rej.items():
                if isinstance(n, int) and not isinstance(n, bool):
                    rejected[str(reason)] = rejected.get(str(reason), 0) + n
    summ = s.summary or {}

    def total(key: str) -> int:
        vals = [_num(ln.get(key)) for ln in [*lines, *s.ends]]
        return int(sum(v for v in vals if not math.isnan(v)))

    def mean(key: str) -> float:
        vals = [v for v in (_num(ln.get(key)) for ln in lines) if not math.isnan(v)]
        return sum(vals) / len(vals) if vals else math.nan

    return {
        "site": s.site,
        "first_val_loss": _num(s.start.get("val_loss")) if s.start else math.nan,
        "final_val_loss": _num(last.get("val_loss")) if last else math.nan,
        "final_round": last["round"] if last else None,
        "rounds_applied": sum(1 for ln in lines if ln.get("status") == "applied"),
        "rounds_resynced": sum(1 for ln in lines if ln.get("status") == "resynced"),
        "rounds_deferred": s.num_deferred,
        "resumes": s.num_resumes,
        "bytes_sent": total("bytes_sent"),
        "bytes_received": total("bytes_received"),
        "mean_sync_s": mean("sync_s"),
        "mean_quorum_s": mean("quorum_s"),
        "mean_round_s": mean("round_s"),
        "wall_s": _num(last.get("wall_s")) if last else 0.0,
        "sync_share": _num(summ.get("sync_share")) if s.summary is not None else None,
        "compression_ratio": summ.get("compression_ratio"),
        "checksum": last.get("checksum") if last else (s.start or {}).get("checksum"),
        "outer_checksum": last.get("outer_checksum") if last else None,
        "owned_buckets": summ.get("owned_buckets", last.get("owned_buckets") if last else None),
        "num_buckets": summ.get("num_buckets"),
        "rejected": rejected,
        "num_errors": sum(len(ln["errors"]) for ln in lines if isinstance(ln.get("errors"), list)),
        "finished": s.summary is not None and not summ.get("interrupted", False),
    }


def _summarize(sites: list[SiteMetrics], run_dir: Path) -> dict:
    per_site = {s.site: _site_summary(s) for s in sites}
    num_sites = len(sites)
    all_rounds = sorted({r for s in sites for r in s.rounds})
    faults = []
    fragment_of: dict[int, int] = {}  # round -> the Streaming DiLoCo fragment it synchronised
    for r in all_rounds:
        members: set[str] = set()
        statuses = {}
        for s in sites:
            ln = s.rounds.get(r)
            if ln is None:
                continue
            if isinstance(ln.get("fragment"), int):
                fragment_of[r] = ln["fragment"]
            statuses[s.site] = ln.get("status")
            if isinstance(ln.get("members"), list):
                members.update(str(m) for m in ln["members"])
        if len(members) < num_sites:
            faults.append(
                {
                    "round": r,
                    "members": sorted(members),
                    "missing": sorted(set(per_site) - members),
                    "statuses": statuses,
                    **({"fragment": fragment_of[r]} if r in fragment_of else {}),
                }
            )
    rejected: dict[str, int] = {}
    for v in per_site.values():
        for reason, n in v["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + n
    # the sites that finished the run (a dead or interrupted site's last checksum is of an earlier round)
    ended = {k: v for k, v in per_site.items() if v["finished"]} or per_site
    checksums = [v["checksum"] for v in ended.values()]
    outer = [v["outer_checksum"] for v in ended.values()]
    return {
        "run_dir": str(run_dir),
        "num_sites": num_sites,
        "num_rounds": len(all_rounds),
        "rounds": all_rounds,
        "sites": per_site,
        "checksums_agree": bool(checksums) and all(c is not None for c in checksums) and len(set(checksums)) == 1,
        "unfinished": sorted(k for k, v in per_site.items() if not v["finished"]),
        "outer_checksums_agree": bool(outer) and all(c is not None for c in outer) and len(set(outer)) == 1,
        "faults": faults,
        "rejected": rejected,
        "num_rejected": sum(rejected.values()),
        "fragment_rounds": {
            str(f): sorted(r for r, g in fragment_of.items() if g == f) for f in sorted(set(fragment_of.values()))
        },
    }


def summarize_run(run_dir: str | Path) -> dict:
    """Summarize a run directory (no files are written).

    Args:
        run_dir: the directory holding ``<site>/metrics.jsonl`` files.

    Returns:
        A JSON-serializable dict: ``run_dir``, ``num_sites``, ``num_rounds`` (distinct round
        numbers any site ran), ``rounds``, ``sites`` (site_id -> ``first_val_loss``,
        ``final_val_loss`` (nats/token; NaN if unknown), ``final_round``, ``rounds_applied``,
        ``rounds_resynced``, ``rounds_deferred``, ``resumes``, ``bytes_sent``, ``bytes_received``
        (bytes: the counted round lines plus the end lines), ``mean_sync_s``, ``mean_quorum_s``,
        ``mean_round_s`` (s: means of those fields over the counted round lines), ``wall_s`` (s), ``sync_share`` (0..1, from summary.json; None
        without one), ``compression_ratio``, ``checksum`` (final θ checksum), ``outer_checksum``
        (final outer-optimizer state checksum, None if not written), ``owned_buckets`` and
        ``num_buckets`` (the last round it ran, from summary.json), ``rejected``
        (reason -> count), ``num_errors``, ``finished`` (summary.json present and not
        interrupted)), ``checksums_agree`` (every site that finished has a final checksum and all
        are equal; every site when none finished), ``unfinished`` (the sites that did not finish:
        a dead site's last checksum is of an earlier round), ``outer_checksums_agree`` (the same
        for ``outer_checksum``),
        ``faults`` (rounds whose quorum held fewer than all sites: ``round``, ``members``,
        ``missing``, ``statuses``, and ``fragment`` for a fragment round), ``rejected`` and
        ``num_rejected`` (over all sites), ``fragment_rounds`` (Streaming DiLoCo: fragment, as
        a string -> the rounds that synchronised it; empty when every round covered the whole model).

    Raises:
        ValueError: ``run_dir`` is not a directory or holds no valid metrics line at all.
    """
    run_dir = Path(run_dir)
    return _summarize(_load_run(run_dir), run_dir)


# ---------------------------------------------------------------- plots


def _new_figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    log.info("wrote %s", path)
    return path


def _site_style(i: int) -> dict:
    """Line style of the i-th site: consistent sites share θ and so the same losses; varying hollow
    marker shapes/sizes and dash patterns keep overlapping lines distinguishable."""
    return {
        "marker": "osD^v<>p"[i % 8],
        "markersize": 9 - 2 * (i % 3),
        "markerfacecolor": "none",
        "linestyle": ("-", "--", ":", "-.")[i % 4],
        "linewidth": 1.5,
    }


def _plot_val_loss(sites: list[SiteMetrics], path: Path, *, over: str) -> Path:
    """Validation loss per site over ``over='round'`` (start line at -1) or ``over='wall'`` (wall_s)."""
    by_round = over == "round"
    fig, ax = _new_figure(
        f"Validation loss per site over {'rounds' if by_round else 'wall time'}",
        "round (-1 = start, before any round)" if by_round else "wall time since site start (s)",
        "validation loss (nats/token)",
    )
    for i, s in enumerate(sites):
        points = [(-1 if by_round else 0.0, s.start)] if s.start is not None else []
        if by_round:
            points += [(r, s.rounds[r]) for r in sorted(s.rounds)]
        else:  # every counted line in file order: a resumed round shows both attempts
            points += [(_num(ln.get("wall_s")), ln) for ln in s.order]
        ax.plot([x for x, _ in points], [_num(ln.get("val_loss")) for _, ln in points], label=s.site, **_site_style(i))
    if by_round:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(title="site")
    return _save(fig, path)


def _per_round(sites: list[SiteMetrics], rounds: list[int], key: str, how: str) -> list[float]:
    """Per round: the mean (``how='mean'``) or sum over sites of ``key``; missing values are skipped."""
    out = []
    for r in rounds:
        vals = [_num(s.rounds[r].get(key)) for s in sites if r in s.rounds]
        vals = [v for v in vals if not math.isnan(v)]
        if not vals:
            out.append(0.0)
        else:
            out.append(sum(vals) / len(vals) if how == "mean" else sum(vals))
    return out


def _plot_sync_time(sites: list[SiteMetrics], rounds: list[int], path: Path) -> Path:
    """Left: sync_s = quorum_s + round_s + the rest; right: round_s by part (means over sites)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), dpi=110)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    sync = _per_round(sites, rounds, "sync_s", "mean")
    quorum = _per_round(sites, rounds, "quorum_s", "mean")
    rnd = _per_round(sites, rounds, "round_s", "mean")
    rest = [max(0.0, s - q - r) for s, q, r in zip(sync, quorum, rnd)]
    parts = [("quorum_s (waiting for the plan)", quorum), ("round_s (round engine)", rnd), ("rest", rest)]
    _stack(left, rounds, parts, _SYNC_COLORS, "sync_s per round (mean over sites)")
    # The engine's timers overlap (encoding streams inside the pushes, concurrent pushes
    # add up), so they are drawn as lines beside round_s, not stacked as a split of it.
    right.set_title("round_s and the engine's timers (mean over sites; timers overlap)")
    right.set_xlabel("round")
    right.set_ylabel("time (s)")
    right.grid(True, alpha=0.3)
    right.bar(rounds, rnd, color="#dddddd", label="round_s", width=0.8)
    for p, color in zip(_ROUND_PARTS, _ROUND_COLORS):
        right.plot(rounds, _per_round(sites, rounds, p, "mean"), marker=".", color=color, label=p)
    right.xaxis.get_major_locator().set_params(integer=True)
    right.legend(loc="upper left", ncols=2, fontsize="small")
    return _save(fig, path)


def _stack(ax, rounds: list[int], parts: list[tuple[str, list[float]]], colors, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("round")
    ax.set_ylabel("time (s)")
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    bottom = [0.0] * len(rounds)
    for (label, vals), color in zip(parts, colors):
        ax.bar(rounds, vals, bottom=bottom, color=color, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(0, max(bottom + [1e-9]) * 1.3)  # headroom for the legend
    ax.legend(loc="upper left", ncols=2, fontsize="small")


def _byte_unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if max_bytes >= scale:
            return scale, name
    return 1.0, "bytes"


def _plot_bytes(sites: list[SiteMetrics], rounds: list[int], path: Path) -> Path:
    sent = _per_round(sites, rounds, "bytes_sent", "sum")
    received = _per_round(sites, rounds, "bytes_received", "sum")
    scale, unit = _byte_unit(max(sent + received + [0.0]))
    fig, ax = _new_figure(
        "bytes_sent and bytes_received per round line (summed over sites)", "round", f"payload ({unit})"
    )
    width = 0.4
    ax.bar([r - width / 2 for r in rounds], [v / scale for v in sent], width=width, label="sent", color="#4c72b0")
    ax.bar(
        [r + width / 2 for r in rounds], [v / scale for v in received], width=width, label="received", color="#dd8452"
    )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(0, max([v / scale for v in sent + received] + [1e-9]) * 1.2)  # headroom for the legend
    ax.legend(loc="upper right", ncols=2)
    return _save(fig, path)


# ---------------------------------------------------------------- markdown


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)


def _fragment_lines(summary: dict) -> list[str]:
    """The Streaming DiLoCo line of the report: which rounds synchronised which fragment."""
    frags = summary.get("fragment_rounds") or {}
    if not frags:
        return []
    parts = [f"fragment {f}: rounds {', '.join(map(str, rs))}" for f, rs in frags.items()]
    return [f"- fragment rounds (Streaming DiLoCo, {len(frags)} fragments): " + "; ".join(parts)]


def _unfinished_note(summary: dict) -> str:
    """Which sites the checksum verdict is over: those that finished, or, when none did (an
    interrupted run), every site's last round line."""
    unfinished = summary.get("unfinished") or []
    if not unfinished:
        return ""
    if len(unfinished) == summary["num_sites"]:
        return " (no site finished: over every site's last round, which may differ between sites)"
    return f" (over the sites that finished; {', '.join(unfinished)} did not)"


def _markdown(summary: dict, images: list[str]) -> str:
    sites = summary["sites"]
    out = [
        f"# dtrain run report: `{summary['run_dir']}`",
        "",
        f"- sites: **{summary['num_sites']}**",
        f"- rounds: **{summary['num_rounds']}**"
        + (f" (rounds {summary['rounds'][0]}..{summary['rounds'][-1]})" if summary["rounds"] else ""),
        "- final θ checksums: "
        + ("**all agree**" if summary["checksums_agree"] else "**DISAGREE** (sites ended with different θ)")
        + _unfinished_note(summary),
        "- final outer-optimizer checksums: "
        + ("**all agree**" if summary["outer_checksums_agree"] else "differ or missing"),
        *_fragment_lines(summary),
        "",
        "## Per site",
        "",
        "| site | first val_loss | final val_loss | final round | rounds applied | bytes_sent | bytes_received "
        "| mean sync_s | mean quorum_s | mean round_s | sync_share | final θ checksum |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, v in sites.items():
        share = "–" if v["sync_share"] is None else _fmt(100 * v["sync_share"], ".1f") + " %"
        out.append(
            f"| {name} | {_fmt(v['first_val_loss'])} | {_fmt(v['final_val_loss'])} | {_fmt(v['final_round'], 'd')} "
            f"| {v['rounds_applied']} | {v['bytes_sent']:,} | {v['bytes_received']:,} | {_fmt(v['mean_sync_s'], '.3f')} "
            f"| {_fmt(v['mean_quorum_s'], '.3f')} | {_fmt(v['mean_round_s'], '.3f')} "
            f"| {share} | `{v['checksum'] if v['checksum'] is not None else '–'}` |"
        )
    notes = []
    for name, v in sites.items():
        bits = []
        if v["rounds_resynced"]:
            bits.append(f"{v['rounds_resynced']} round(s) resynced")
        if v["rounds_deferred"]:
            bits.append(f"{v['rounds_deferred']} round attempt(s) deferred")
        if v["resumes"]:
            bits.append(f"resumed {v['resumes']} time(s)")
        if v["num_errors"]:
            bits.append(f"{v['num_errors']} peer error(s)")
        if not v["finished"]:
            bits.append("no summary.json or interrupted (site did not finish cleanly)")
        if bits:
            notes.append(f"- {name}: " + "; ".join(bits))
    if notes:
        out += ["", *notes]
    out += [
        "",
        "Times in seconds, bytes in payload bytes; every column is the metrics field of that name "
        "(docs/METRICS.md): sync_s = quorum_s + round_s + the pseudo-gradient and θ copies; "
        "sync_share = sync_s / wall_s over the site's last process (summary.json).",
        "",
        "## Faults",
        "",
    ]
    if summary["faults"]:
        out.append(f"{len(summary['faults'])} round(s) ran with fewer than {summary['num_sites']} sites:")
        out.append("")
        for f in summary["faults"]:
            out.append(
                f"- round {f['round']}"
                + (f" (fragment {f['fragment']})" if "fragment" in f else "")
                + f": members {', '.join(f['members']) or '(none)'}; missing {', '.join(f['missing'])}"
            )
    else:
        out.append(f"Every round's quorum held all {summary['num_sites']} sites.")
    out += ["", "## Rejected contributions", ""]
    if summary["num_rejected"]:
        out.append(f"{summary['num_rejected']} contribution(s) rejected by owners:")
        out.append("")
        for reason, n in sorted(summary["rejected"].items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"- {reason}: {n}")
    else:
        out.append("None (0).")
    out += ["", "## Plots", ""]
    for img in images:
        out.append(f"![{img}]({img})")
    out.append("")
    return "\n".join(out)


def make_report(run_dir: str | Path) -> list[Path]:
    """Write the plots and ``report.md`` of a run into ``run_dir``.

    Args:
        run_dir: the run directory (``RUN_DIR`` of ``dtrain launch --out RUN_DIR``).

    Returns:
        The written paths, in :data:`REPORT_FILES` order (4 PNGs, then ``report.md``).
        Existing files of these names are replaced (each written to a temporary name, then renamed).

    Raises:
        ValueError: ``run_dir`` is not a directory or holds no valid metrics line at all.
    """
    run_dir = Path(run_dir)
    sites = _load_run(run_dir)
    summary = _summarize(sites, run_dir)
    rounds = summary["rounds"]
    written = [
        _plot_val_loss(sites, run_dir / REPORT_FILES[0], over="round"),
        _plot_val_loss(sites, run_dir / REPORT_FILES[1], over="wall"),
        _plot_sync_time(sites, rounds, run_dir / REPORT_FILES[2]),
        _plot_bytes(sites, rounds, run_dir / REPORT_FILES[3]),
    ]
    md_path = run_dir / REPORT_FILES[4]
    tmp = md_path.with_name(md_path.name + ".tmp")
    tmp.write_text(_markdown(summary, [p.name for p in written]), encoding="utf-8")
    tmp.replace(md_path)
    log.info("wrote %s", md_path)
    written.append(md_path)
    return written
