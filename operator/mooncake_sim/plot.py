"""PNG chart of simulation results (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_results(results: list[dict[str, Any]], settings: dict[str, Any], out: Path) -> None:
    names = [r["policy"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [
        ("ttft_mean_s", "mean TTFT (s)", 1.0),
        ("slo_attainment", "SLO attainment (%)", 100.0),
        ("token_hit_ratio", "prompt tokens reused (%)", 100.0),
    ]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        vals = [r[key] * scale for r in results]
        colors = ["#d62728" if n == "conductor" else "#1f77b4" for n in names]
        ax.barh(names, vals, color=colors)
        ax.set_xlabel(label)
        ax.invert_yaxis()
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    fig.suptitle(
        f"{Path(str(settings['trace'])).name}: {settings['requests']} requests, "
        f"{settings['prefill']}P+{settings['decode']}D, speed {settings['speed']:.2f}x"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_capacity(results: list[dict[str, Any]], settings: dict[str, Any], out: Path) -> None:
    """Capacity per policy against the upper bound at the target; with a P/D sweep, capacity per
    prefill count, one line per policy."""
    title = (f"{Path(str(settings['trace'])).name}: effective capacity "
             f"({100 * settings['target']:g}% of all requests within both SLOs)")
    fig, ax = plt.subplots(figsize=(9, 4.8))
    if settings.get("pd_sweep"):
        by_policy: dict[str, list[dict[str, Any]]] = {}
        for r in results:
            by_policy.setdefault(r["policy"], []).append(r)
        for name, rows in by_policy.items():
            rows.sort(key=lambda r: r["prefill"])
            ax.plot([r["prefill"] for r in rows], [r["capacity_speed"] for r in rows],
                    marker="o", label=name)
        limit_rows = sorted({(r["prefill"], r["limit_speed"]) for r in results})
        ax.plot([p for p, _ in limit_rows], [v for _, v in limit_rows], "k--",
                label="ideal-reuse compute of all requests (not a bound)")
        bound_rows = sorted({(r["prefill"], r["limit_target_speed"]) for r in results})
        ax.plot([p for p, _ in bound_rows], [v for _, v in bound_rows], "k:",
                label="upper bound at the target (cheapest share, SLO drain)")
        ax.set_xlabel(f"prefill instances (of {settings['pd_sweep']}; the rest decode)")
        ax.set_ylabel("capacity (replay speed, x)")
        ax.legend(fontsize=8)
    else:
        names = [r["policy"] for r in results]
        vals = [r["capacity_speed"] for r in results]
        colors = ["#d62728" if n == "conductor" else "#1f77b4" for n in names]
        ax.barh(names, vals, color=colors)
        limit = results[0]["limit_speed"] if results else 0.0
        ax.axvline(limit, color="k", linestyle="--",
                   label="ideal-reuse compute of all requests (not a bound)")
        if results:
            ax.axvline(results[0]["limit_target_speed"], color="k", linestyle=":",
                       label="upper bound at the target")
        for i, r in enumerate(results):
            pct = "" if r["of_bound"] is None else f" ({100 * r['of_bound']:.0f}% of bound)"
            ax.text(vals[i], i, f" {vals[i]:.3g}x{pct}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("capacity (replay speed, x)")
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
