"""Bench figures (matplotlib, Agg backend) drawn from the bench JSON (``{"config", "results"}``).

Three panels: per-position acceptance per method; tokens/s vs concurrency for ar / fixed K / adaptive; τ (solid,
left axis) and the decode-phase speed-up over AR (dashed, right axis) vs context depth (rows whose dataset ends in
``@ctx<N>``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CONCURRENCY_METHODS = ("ar", "dspark", "dspark-adaptive")
_CTX = re.compile(r"@ctx(\d+)$")


def context_depth(dataset: str) -> int | None:
    m = _CTX.search(dataset)
    return int(m.group(1)) if m else None


def _base_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if context_depth(r["dataset"]) is None]


def plot_report(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the three-panel PNG for a bench report; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["results"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _per_position(axes[0], rows)
    _concurrency(axes[1], rows)
    _depth(axes[2], rows)
    model = Path(str(report.get("config", {}).get("model", ""))).name
    fig.suptitle(f"dspark bench — {model}" if model else "dspark bench")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_position(ax: Any, rows: list[Mapping[str, Any]]) -> None:
    base = _base_rows(rows)
    conc = min((r["concurrency"] for r in base), default=1)
    drawn = 0
    for r in base:
        pos = r["per_position_acceptance"]
        if r["concurrency"] != conc or not pos:
            continue
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=f"{r['name']} T={r['temperature']:g}")
        drawn += 1
    ax.set_title(f"per-position acceptance (concurrency {conc})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted)")
    ax.set_ylim(0, 1.02)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speculative rows", ha="center", transform=ax.transAxes)


def _concurrency(ax: Any, rows: list[Mapping[str, Any]]) -> None:
    base = _base_rows(rows)
    for name in CONCURRENCY_METHODS:
        for t in sorted({r["temperature"] for r in base}):
            mine = [r for r in base if r["name"] == name and r["temperature"] == t]
            pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in mine)
            if pts:
                label = {"dspark": "dspark (fixed K)"}.get(name, name)
                ax.plot(*zip(*pts), marker="o", label=f"{label} T={t:g}")
    concs = sorted({r["concurrency"] for r in base})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs or [1], [str(c) for c in concs or [1]])
    ax.set_title("throughput vs concurrency")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=7)


def _depth(ax: Any, rows: list[Mapping[str, Any]]) -> None:
    deep = [r for r in rows if context_depth(r["dataset"]) is not None and r["acceptance_length"] is not None]
    series = sorted({(r["name"], r["temperature"]) for r in deep})
    speed_ax = ax.twinx() if series else None
    for name, t in series:
        mine = sorted(
            (r for r in deep if r["name"] == name and r["temperature"] == t), key=lambda r: context_depth(r["dataset"])
        )
        depths = [context_depth(r["dataset"]) for r in mine]
        line = ax.plot(depths, [r["acceptance_length"] for r in mine], marker="o", label=f"{name} T={t:g} τ")[0]
        speed = [(d, r.get("decode_speedup_vs_ar")) for d, r in zip(depths, mine) if r.get("decode_speedup_vs_ar")]
        if speed and speed_ax is not None:
            speed_ax.plot(*zip(*speed), marker="s", linestyle="--", color=line.get_color(), label=f"{name} T={t:g} ×")
    ax.set_title("τ and decode speed-up vs context depth")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("τ (mean acceptance length), solid")
    if series and speed_ax is not None:
        depths = sorted({context_depth(r["dataset"]) for r in deep})
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(d) for d in depths])
        speed_ax.set_ylabel("decode speed-up over AR, dashed")
        speed_ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.legend(fontsize=7, loc="lower left")
    else:
        ax.text(0.5, 0.5, "run with --context-depths 1024,4096,16384", ha="center", transform=ax.transAxes)
