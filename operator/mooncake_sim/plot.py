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
