"""The output files of ``experiments/vs_torchft.py``: ``results.json``, ``rounds.csv``,
``summary.csv``, ``loss_vs_wall.png`` and ``report.md``, from the numbers and the report of
``vs_torchft_analysis.py`` (whose docstring defines every figure).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from experiments.vs_torchft_analysis import _lines, _site_dirs, report_md

__all__ = ["write_outputs", "plot"]


def write_outputs(res: dict, records, out: Path) -> str:
    out = Path(out)
    repo = Path(__file__).resolve().parents[1]
    res["out_dir"] = str(out.resolve().relative_to(repo)) if out.resolve().is_relative_to(repo) else str(out)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    with open(out / "rounds.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "system",
                "scenario",
                "repeat",
                "site",
                "round",
                "status",
                "members",
                "val_loss",
                "train_loss",
                "inner_s",
                "sync_s",
                "t_since_go_s",
                "bytes_sent",
            ]
        )
        for r in records:
            for s in _site_dirs(Path(r.dir)):
                for d in _lines(Path(r.dir), s):
                    if d.get("event") != "round":
                        continue
                    mem = d.get("members")
                    w.writerow(
                        [
                            r.spec.system,
                            r.spec.scenario,
                            r.spec.repeat,
                            s,
                            d["round"],
                            d.get("status"),
                            len(mem) if isinstance(mem, list) else mem,
                            d["val_loss"],
                            d.get("train_loss"),
                            round(d["inner_s"], 4),
                            round(d["sync_s"], 4),
                            round(d["time"] - r.t_go, 3),
                            d.get("bytes_sent", 0),
                        ]
                    )
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        cols = [
            "system",
            "scenario",
            "sites",
            "rounds",
            "round_wall_median_s",
            "round_wall_min_s",
            "round_wall_max_s",
            "sync_median_s",
            "sync_max_s",
            "final_val_loss_mean",
            "final_val_loss_per_site",
            "bytes_per_round_total",
            "peak_rss_mb_max",
            "coordinator_rss_mb",
            "checksums_agree",
            "wall_total_s",
            "longest_stall_s",
            "error",
        ]
        w.writerow(cols)
        for _key, st in res["runs"].items():
            w.writerow(
                [
                    st["system"],
                    st["scenario"],
                    st["sites"],
                    st["rounds"],
                    st["round_wall_s"]["median"],
                    st["round_wall_s"]["min"],
                    st["round_wall_s"]["max"],
                    st["sync_s"]["median"],
                    st["sync_s"]["max"],
                    st["final_val_loss_mean"],
                    ";".join(f"{k}={v:.4f}" for k, v in st["final_val_loss"].items()),
                    st["bytes_per_round_total"],
                    st["peak_rss_mb_max"],
                    st["coordinator_rss_mb"],
                    st["checksums_agree"],
                    st["wall_total_s"],
                    st.get("fault", {}).get("longest_stall_s"),
                    st["error"] or "",
                ]
            )
    plot(records, out / "loss_vs_wall.png")
    report = report_md(res)
    (out / "report.md").write_text(report)
    return report


def plot(records, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    order = {"healthy": 0, "concurrent": 1, "fault": 2}
    scens = sorted(
        {r.spec.scenario for r in records if " codec=" not in r.spec.scenario and r.spec.scenario != "profile"},
        key=lambda sc: (order.get(sc, 3), sc),
    )
    ncol = min(3, len(scens))
    nrow = (len(scens) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 4.4 * nrow), squeeze=False)
    colors = {"dtrain": "tab:blue", "torchft": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    for ax, scen in zip(axes.flat, scens):
        later, start_loss = [], None  # y range: everything after each site's first round (the start is off the top)
        marks = []
        for r in [r for r in records if r.spec.scenario == scen]:
            for k, s in enumerate(_site_dirs(Path(r.dir))):
                if r.spec.repeat and s != "site-0":  # repeats: one line each (replicas agree), drawn faintly
                    continue
                pts = [
                    (d["time"] - r.t_go, d["val_loss"])
                    for d in _lines(Path(r.dir), s)
                    if d.get("event") in ("start", "round") and d.get("val_loss") is not None
                ]
                if not pts:
                    continue
                start_loss = start_loss or pts[0][1]
                later += [y for _, y in pts[2:]]
                xs, ys = zip(*pts)
                ax.plot(
                    xs,
                    ys,
                    styles[k % len(styles)],
                    color=colors[r.spec.system],
                    marker="o" if r.spec.system == "dtrain" else "s",
                    markersize=3.5,
                    markerfacecolor="none",
                    linewidth=1.3 if not r.spec.repeat else 0.9,
                    alpha=1.0 if not r.spec.repeat else 0.45,
                    label=f"{r.spec.system} {s}" + (f" (repeat {r.spec.repeat})" if r.spec.repeat else ""),
                )
            marks += [
                (t - r.t_go, f"{r.spec.system} {lab}", colors[r.spec.system])  # noqa: B023
                for t, lab in ((r.t_kill, "kill"), (r.t_restart, "restart"))
                if t
            ]
        if later:
            lo, hi = min(later), max(later)
            ax.set_ylim(lo - 0.05 * (hi - lo) - 0.01, hi + 0.25 * (hi - lo) + 0.01)
        for n, (x, lab, col) in enumerate(marks):
            ax.axvline(x, color=col, linestyle=":", alpha=0.7)
            ax.text(
                x,
                ax.get_ylim()[1] - (0.03 + 0.2 * (n % 4)) * (ax.get_ylim()[1] - ax.get_ylim()[0]),
                f" {lab}",
                rotation=90,
                va="top",
                fontsize=7,
                color=col,
            )
        ax.set_title(
            f"{scen} (all sites start at loss {start_loss:.2f}, above the plot)" if start_loss else scen, fontsize=9
        )
        ax.set_xlabel("wall time since the sites were started (s)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(scens) :]:
        ax.set_visible(False)
    fig.suptitle(
        "dtrain vs torchft 0.2.0 DiLoCo\nvalidation loss over wall time (same task, H, optimizers)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
