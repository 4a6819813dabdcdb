"""The status page's HTML: tables and inline SVG charts rendered from the status
document of :func:`dtrain.status.build_status` (pure functions, no I/O).

Everything is self-contained (no CDN, no external fonts or scripts): the page
works with no internet. A few lines of inline JavaScript fetch ``fragment``
every ``refresh_s`` seconds and swap the content in place (no flicker, scroll
kept); without JavaScript a ``<noscript>`` meta refresh reloads the page.
Every value that comes from a site (ids, addresses, reasons) is HTML-escaped.
Elements tests and scripts can find: ``#round-counter`` (rounds formed so
far), ``#sites tr[data-site=ID]`` with ``data-state``, ``#rounds
tr[data-round=R]``, ``svg#chart-val-loss`` and ``svg#chart-sync``.
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
from html import escape
from typing import Any, Mapping, Sequence

__all__ = ["render_page", "render_fragment", "svg_line_chart", "SCRIPT_TEMPLATE", "csp_header"]

# tab10: distinguishable, and the colour-blind-safe-ish default of matplotlib (the report's plots use it too)
DASHES = ("", "7 4", "2 3", "10 3 2 3")
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:16px 24px;color:#1b1f24;background:#fafbfc}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}
.meta{color:#57606a;margin-bottom:8px}.big{font-size:18px;font-weight:600;color:#1b1f24}
table{border-collapse:collapse;background:#fff;box-shadow:0 0 0 1px #d0d7de;min-width:60%}
th,td{padding:4px 10px;text-align:right;border-bottom:1px solid #eaeef2;white-space:nowrap}
th{background:#f3f5f7;font-weight:600}td.l,th.l{text-align:left}td.wrap{white-space:normal;max-width:420px}
.st{display:inline-block;padding:1px 8px;border-radius:10px;font-weight:600;font-size:12px;color:#fff}
.st-training{background:#2da44e}.st-in-round{background:#0969da}.st-late{background:#bf8700}
.st-dead{background:#cf222e}.st-joining{background:#8250df}.st-left{background:#6e7781}
tr.dead td{color:#8c959f}.charts{display:flex;flex-wrap:wrap;gap:16px}
svg.chart{background:#fff;box-shadow:0 0 0 1px #d0d7de}svg.chart text{font:11px system-ui,sans-serif;fill:#57606a}
svg.chart text.title{font-size:13px;font-weight:600;fill:#1b1f24}.grid{stroke:#eaeef2}.axis{stroke:#8c959f}
#conn{background:#ffebe9;color:#82071e;padding:4px 10px;margin:6px 0;border:1px solid #ff8182}
.warn{color:#9a6700}
"""

#: The refresh script; ``%REFRESH_MS%`` is replaced by the interval.
SCRIPT_TEMPLATE = """(function(){
var ms=%REFRESH_MS%,content=document.getElementById('content'),conn=document.getElementById('conn');
function tick(){
  fetch('fragment',{cache:'no-store'}).then(function(r){
    if(!r.ok){throw new Error('HTTP '+r.status);}
    return r.text();
  }).then(function(html){content.innerHTML=html;conn.hidden=true;}).catch(function(e){
    conn.hidden=false;conn.textContent='status not updated: '+e.message+'; retrying every '+(ms/1000)+' s';
  }).then(function(){setTimeout(tick,ms);});
}
setTimeout(tick,ms);
})();"""


def _sha256_b64(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _script(refresh_s: float) -> str:
    return SCRIPT_TEMPLATE.replace("%REFRESH_MS%", str(int(refresh_s * 1000)))


def csp_header(refresh_s: float) -> str:
    """Content-Security-Policy of the page: only its own inline script and style
    (by hash), fetches to the same origin, nothing else."""
    return (
        f"default-src 'none'; script-src 'sha256-{_sha256_b64(_script(refresh_s))}'; "
        f"style-src 'sha256-{_sha256_b64(STYLE)}'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


# --------------------------------------------------------------------------- formatting
def _num(v: Any, fmt: str = "{:.4f}") -> str:
    return "–" if v is None else fmt.format(v)


def _bytes(v: Any) -> str:
    if v is None:
        return "–"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= div:
            return f"{v / div:.2f} {unit}"
    return f"{int(v)} B"


def _frac(v: Any) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _reasons(d: Mapping[str, int]) -> str:
    return ", ".join(f"{escape(k)}: {c}" for k, c in sorted(d.items())) or "–"


# --------------------------------------------------------------------------- charts
def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = hi - lo
    raw = span / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def svg_line_chart(
    series: Mapping[str, Sequence[Sequence[float]]],
    *,
    chart_id: str,
    title: str,
    y_label: str,
    colors: Mapping[str, str],
    width: int = 560,
    height: int = 260,
) -> str:
    """One inline SVG line chart: a line per series of ``[x, y]`` points (x: round).

    Args:
        series: name -> points, in x order. Empty series are left out.
        chart_id: the ``id`` of the ``<svg>`` element.
        colors: name -> CSS colour.
    Returns:
        ``<svg>`` markup (escaped labels); a "no data yet" placeholder when
        there are no points.
    """
    left, right, top, bottom = 56, 96, 28, 36
    pw, ph = width - left - right, height - top - bottom
    pts = [(float(x), float(y)) for s in series.values() for x, y in s]
    out = [
        f'<svg id="{escape(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text class="title" x="{left}" y="17">{escape(title)}</text>',
    ]
    if not pts:
        out.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle">no rounds reported yet</text></svg>'
        )
        return "".join(out)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 - x0 < 1:
        x0, x1 = x0 - 0.5, x1 + 0.5
    pad = (y1 - y0) * 0.08 or max(abs(y1) * 0.1, 0.05)
    y0, y1 = (max(0.0, y0 - pad) if y0 >= 0 else y0 - pad), y1 + pad

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    for t in _nice_ticks(y0, y1):
        out.append(
            f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
            f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>'
        )
    for t in _nice_ticks(x0, x1, n=8):
        if abs(t - round(t)) < 1e-9:
            out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{int(round(t))}</text>')
    out.append(
        f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}"/>'
        f'<line class="axis" x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}"/>'
        f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle">round</text>'
        f'<text transform="translate(13,{top + ph / 2}) rotate(-90)" text-anchor="middle">{escape(y_label)}</text>'
    )
    for i, (name, s) in enumerate(sorted((n, s) for n, s in series.items() if s)):
        color = escape(colors.get(name, PALETTE[i % len(PALETTE)]))
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        dash = DASHES[i % len(DASHES)]  # consistent sites have equal losses: dashes keep overlapping lines visible
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<polyline data-series="{escape(name)}" fill="none" stroke="{color}" stroke-width="2"{dash_attr} points="{path}"/>'
        )
        if len(s) <= 60:
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>' for x, y in s)
        ly = top + 8 + 16 * i
        out.append(
            f'<line x1="{left + pw + 10}" x2="{left + pw + 26}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="3"{dash_attr}/>'
            f'<text x="{left + pw + 30}" y="{ly + 4}">{escape(name)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------- page
_DEADLINES = ("quorum_timeout_s", "reduce_timeout_s", "broadcast_timeout_s")


def _sites_table(status: Mapping[str, Any]) -> str:
    rows = []
    for s in status["sites"]:
        sid = escape(s["site_id"])
        st = s["state"]
        rows.append(
            f'<tr data-site="{sid}" data-state="{escape(st)}" class="{"dead" if st in ("dead", "left") else ""}">'
            f'<td class="l">{sid}</td><td class="l">{escape(s["address"])}</td>'
            f'<td class="l"><span class="st st-{escape(st.replace(" ", "-"))}" title="{escape(s["state_reason"])}">{escape(st)}</span></td>'
            f"<td>{s['heartbeat_age_s']:.1f} s</td><td>{_num(s.get('phi'), '{:.1f}')}</td>"
            f"<td>{s['rounds_joined']}</td><td>{s['inner_step']}</td>"
            f"<td>{_num(s['val_loss'])}</td><td>{_num(s['train_loss'])}</td><td>{_num(s['last_reported_round'], '{}')}</td>"
            f"<td>{_num(s['last_sync_s'], '{:.2f} s')}</td><td>{_num(s.get('round_steps'), '{}')}</td>"
            f"<td>{_num(s.get('tokens_per_s'), '{:.0f}')}</td><td>{_num(s.get('weight'), '{}')}</td>"
            f"<td>{_bytes(s['bytes_sent_total'])}</td>"
            f'<td class="l wrap">{escape(s["state_reason"])}</td></tr>'
        )
    head = (
        "<tr><th class=l>site</th><th class=l>address</th><th class=l>state</th><th>last heartbeat</th>"
        '<th title="phi accrual suspicion of its silence: dead at the configured dead_phi">φ</th>'
        "<th>rounds joined</th><th>inner step</th><th>val loss</th><th>train loss</th><th>last round</th>"
        '<th>last sync</th><th title="inner steps of its last round">steps/round</th><th>tokens/s</th>'
        '<th title="its token claim in its last round: its weight in a token-weighted mean">weight</th>'
        "<th>sent</th><th class=l>why</th></tr>"
    )
    body = "".join(rows) or '<tr><td class="l" colspan="16">no site has joined yet</td></tr>'
    return f'<table id="sites"><thead>{head}</thead><tbody>{body}</tbody></table>'


def _fragment(row: Mapping[str, Any]) -> str:
    """`` (fragment f)`` after a fragment round's number (Streaming DiLoCo), else nothing."""
    f = row.get("fragment")
    return f' <span class="frag">(fragment {int(f)})</span>' if isinstance(f, int) else ""


def _rounds_table(status: Mapping[str, Any]) -> str:
    rows = []
    for r in status["rounds"]:
        members = r["members"]
        rows.append(
            f'<tr data-round="{r["round"]}"><td>{r["round"]}{_fragment(r)}</td>'
            f'<td class="l">{escape(", ".join(members))}</td>'
            f"<td>{r['num_reported']}/{len(members)}</td>"
            f"<td>{_frac(r['reduce_arrived_fraction_min'])}</td><td>{_frac(r['broadcast_arrived_fraction_min'])}</td>"
            f"<td>{_num(r['sync_s_max'], '{:.2f} s')}</td><td>{_bytes(r['bytes_sent'])}</td>"
            f"<td>{r['stale_buckets']} / {r['repaired_buckets']}</td>"
            f'<td class="l wrap">{_reasons(r["rejected"])}</td>'
            f'<td class="l wrap">{escape("; ".join(r["notes"])) or "–"}</td></tr>'
        )
    head = (
        "<tr><th>round</th><th class=l>members</th><th>reported</th><th>reduce arrived (min)</th>"
        "<th>broadcast arrived (min)</th><th>sync (max)</th><th>sent</th><th>stale / repaired</th>"
        "<th class=l>rejected (code: count)</th><th class=l>notes</th></tr>"
    )
    body = "".join(rows) or '<tr><td class="l" colspan="10">no round has formed yet</td></tr>'
    return f'<table id="rounds"><thead>{head}</thead><tbody>{body}</tbody></table>'


def render_fragment(status: Mapping[str, Any], *, now_unix: float | None = None) -> str:
    """The page's live content (what ``fragment`` returns and the refresh swaps in)."""
    cfg = status["config"]
    counts = ", ".join(f"{n} {escape(st)}" for st, n in status["site_counts"].items() if n) or "no sites"
    colors = {s["site_id"]: PALETTE[i % len(PALETTE)] for i, s in enumerate(status["sites"])}
    when = time.strftime("%H:%M:%S", time.localtime(now_unix if now_unix is not None else time.time()))
    dropped = status["num_reports_dropped"]
    return "".join(
        [
            f'<div class="meta"><span class="big">round <span id="round-counter">{status["next_round"]}</span></span>'
            f" (rounds formed so far) · sites: {counts} · updated {when}</div>",
            f'<div class="meta">heartbeat every {cfg["heartbeat_interval_s"]:g} s, dead after '
            + (
                f"φ ≥ {cfg['dead_phi']:g} of its own heartbeat arrivals (the φ column)"
                if cfg.get("failure_detector") == "accrual"
                else f"{cfg['heartbeat_timeout_s']:g} s"
            )
            + f" · min sites {cfg['min_sites']}</div>"
            + (
                f'<div class="meta">next round\'s deadlines: quorum {cfg["quorum_timeout_s"]:.2f} s, reduce '
                f"{cfg['reduce_timeout_s']:.2f} s, broadcast {cfg['broadcast_timeout_s']:.2f} s "
                f"(why: {escape(cfg.get('deadline_reason') or 'set')})"
                if all(isinstance(cfg.get(k), (int, float)) for k in _DEADLINES)
                else '<div class="meta">'
            )
            + (f' · <span class="warn">{dropped} bad round reports dropped</span>' if dropped else "")
            + "</div>",
            "<h2>Sites</h2>",
            _sites_table(status),
            '<h2>Charts</h2><div class="charts">',
            svg_line_chart(
                {k: v["val_loss"] for k, v in status["series"].items()},
                chart_id="chart-val-loss",
                title="validation loss per round",
                y_label="nats/token",
                colors=colors,
            ),
            svg_line_chart(
                {k: v["sync_s"] for k, v in status["series"].items()},
                chart_id="chart-sync",
                title="sync time per round",
                y_label="seconds",
                colors=colors,
            ),
            "</div>",
            f"<h2>Rounds (newest {len(status['rounds'])})</h2>",
            _rounds_table(status),
        ]
    )


def render_page(status: Mapping[str, Any], *, refresh_s: float = 2.0, now_unix: float | None = None) -> str:
    """The whole status page (``/``)."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<noscript><meta http-equiv="refresh" content="{max(1, round(refresh_s))}"></noscript>'
        f"<title>dtrain status</title><style>{STYLE}</style></head><body>"
        "<h1>dtrain · rendezvous status</h1>"
        f'<div class="meta">read-only; refreshes every {refresh_s:g} s · JSON: <a href="api/status">/api/status</a> ·'
        ' Prometheus: <a href="metrics">/metrics</a></div>'
        '<div id="conn" hidden></div>'
        f'<div id="content">{render_fragment(status, now_unix=now_unix)}</div>'
        f"<script>{_script(refresh_s)}</script></body></html>"
    )
