"""The chart's Grafana dashboard, evaluated against a Prometheus and rendered to PNG.

Grafana is not needed: every timeseries panel's PromQL targets get Grafana's variables
substituted (:func:`panel_queries`), are run as range queries, and each panel becomes one
matplotlib figure plus a row in ``index.md`` (:func:`render`). Units follow the panel's
Grafana ``fieldConfig.defaults.unit`` (:func:`unit_scale`); legends follow each target's
``legendFormat`` (:func:`legend`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_monitoring import promapi

__all__ = ["DASHBOARD_PATH", "PanelQuery", "PanelResult", "Report", "Scale", "format_value",
           "legend", "load_dashboard", "panel_queries", "render", "unit_scale"]

#: The dashboard the chart ships (a ConfigMap for Grafana's sidecar), in a source checkout.
DASHBOARD_PATH = (Path(__file__).resolve().parents[2]
                  / "charts" / "mooncake-operator" / "files" / "dashboard.json")

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(.+?)\s*\}\}")


@dataclass(frozen=True)
class PanelQuery:
    """One target of one timeseries panel, its expression ready for Prometheus."""

    panel: str
    unit: str
    expr: str
    legend: str
    ref: str


@dataclass(frozen=True)
class Scale:
    """How a unit is shown: values are multiplied by ``factor``, the axis says ``label``."""

    factor: float
    label: str
    suffix: str


@dataclass(frozen=True)
class PanelResult:
    """One rendered panel: its PNG and how many series each target (by refId) returned."""

    title: str
    unit: str
    png: Path
    series_counts: dict[str, int]


@dataclass
class Report:
    """Everything :func:`render` wrote; ``empty()`` names the targets that returned nothing."""

    index: Path
    panels: list[PanelResult] = field(default_factory=list)

    def empty(self) -> list[str]:
        return [f"{p.title} [{ref}]" for p in self.panels
                for ref, n in p.series_counts.items() if n == 0]


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict[str, Any]:
    """Read a dashboard JSON file (the chart's by default)."""
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def panel_queries(
    dashboard: dict[str, Any], model: str = ".*", rate_interval: str = "1m"
) -> list[PanelQuery]:
    """Every timeseries panel's targets, in dashboard order, with variables substituted.

    ``$model``/``${model}`` become ``model`` (a regex: the panels match it with ``=~``);
    ``$__rate_interval`` and ``$__interval`` become ``rate_interval``. Any other variable
    raises ValueError naming it, since Prometheus would reject or misread the expression.
    """
    return [q for group in _panel_groups(dashboard, model, rate_interval) for q in group]


def _panel_groups(dashboard: dict[str, Any], model: str, rate_interval: str
                  ) -> list[list[PanelQuery]]:
    """The queries of each timeseries panel (rows' nested panels included), one list each."""
    values = {"model": model, "__rate_interval": rate_interval, "__interval": rate_interval}
    groups = []
    for panel in _timeseries_panels(dashboard.get("panels", [])):
        title = str(panel.get("title", ""))
        unit = str(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))
        groups.append([
            PanelQuery(title, unit, _substitute(t["expr"], values, title),
                       str(t.get("legendFormat", "")), str(t.get("refId", "")))
            for t in panel.get("targets", []) if t.get("expr")
        ])
    return groups


def _timeseries_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for panel in panels:
        if panel.get("type") == "timeseries":
            found.append(panel)
        found.extend(_timeseries_panels(panel.get("panels", [])))  # a collapsed row's panels
    return found


def _substitute(expr: str, values: dict[str, str], panel: str) -> str:
    unknown = sorted({m[1] or m[2] for m in _VARIABLE.finditer(expr)} - set(values))
    if unknown:
        raise ValueError(f"panel {panel!r}: unknown Grafana variable(s) "
                         f"{', '.join('$' + u for u in unknown)} in {expr!r}")
    return _VARIABLE.sub(lambda m: values[m[1] or m[2]], expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: ``{{name}}`` (spaces allowed) becomes the label, or "" if absent.

    An empty format (or Grafana's ``__auto``) shows the whole label set, ``{a="1", b="2"}``.
    """
    if fmt in ("", "__auto"):
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return _LEGEND_LABEL.sub(lambda m: labels.get(m[1], ""), fmt)


def unit_scale(unit: str, peak: float) -> Scale:
    """The display of a Grafana unit given the panel's largest value ``peak``.

    ``s``: milliseconds when the peak is under one second, else seconds; ``percentunit``
    (a 0-1 ratio): ×100, "%"; ``reqps``: requests/s; ``ops``: per second; ``short``, none, or
    anything else: the values as they are, the axis named by the unit (if any).
    """
    if unit == "s":
        return Scale(1000.0, "milliseconds", "ms") if peak < 1 else Scale(1.0, "seconds", "s")
    fixed = {"percentunit": Scale(100.0, "%", "%"), "reqps": Scale(1.0, "requests/s", "req/s"),
             "ops": Scale(1.0, "per second", "/s"), "short": Scale(1.0, "", "")}
    return fixed.get(unit, Scale(1.0, unit, unit))


def format_value(value: float, scale: Scale) -> str:
    """``value`` in ``scale``'s unit with three significant digits, e.g. ``12.5 ms``."""
    if math.isnan(value):
        return "NaN"
    text = f"{value * scale.factor:.3g}"
    return f"{text}{scale.suffix}" if scale.suffix == "%" else f"{text} {scale.suffix}".rstrip()


def render(
    prom_url: str, start: float, end: float, out_dir: Path, step: float = 5.0,
    model: str = ".*", rate_interval: str = "1m", title: str = "",
    dashboard: dict[str, Any] | None = None,
) -> Report:
    """Query every panel over [start, end] and write ``<nn>-<slug>.png`` each plus index.md.

    ``dashboard`` defaults to the chart's (:data:`DASHBOARD_PATH`). A failing query raises
    :class:`promapi.PromError` naming the panel and target.
    """
    board = load_dashboard() if dashboard is None else dashboard
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir / "index.md")
    rows = []
    for n, queries in enumerate(_panel_groups(board, model, rate_interval), start=1):
        if not queries:
            continue
        panel, unit = queries[0].panel, queries[0].unit
        lines = [(q, s) for q in queries for s in _run(prom_url, q, start, end, step)]
        scale = unit_scale(unit, _peak([s for _, s in lines]))
        png = out_dir / f"{n:02d}-{_slug(panel)}.png"
        _plot(png, f"{title}: {panel}" if title else panel, lines, start, scale)
        counts = {q.ref: sum(1 for r, _ in lines if r is q) for q in queries}
        report.panels.append(PanelResult(panel, unit, png, counts))
        rows.append(_index_row(report.panels[-1], lines, scale))
    heading = title or str(board.get("title", "Dashboard"))
    report.index.write_text(_index(heading, start, end, step, rows))
    return report


def _run(url: str, q: PanelQuery, start: float, end: float, step: float
         ) -> list[promapi.Series]:
    try:
        return promapi.query_range(url, q.expr, start, end, step)
    except promapi.PromError as e:
        raise promapi.PromError(f"panel {q.panel!r} [{q.ref}]: {e}", error_type=e.error_type,
                                status=e.status) from e


def _peak(series: list[promapi.Series]) -> float:
    """The largest finite absolute value over all series (0 when there is none)."""
    return max((abs(v) for s in series for v in s.values if math.isfinite(v)), default=0.0)


def _last(series: promapi.Series) -> float:
    """The last non-NaN value, like Grafana's "Last *" reducer (NaN when there is none)."""
    return next((v for v in reversed(series.values) if not math.isnan(v)), math.nan)


def _name(q: PanelQuery, s: promapi.Series) -> str:
    """The series' legend; when that comes out blank, its label set (or the expression)."""
    return legend(q.legend, s.labels).strip() or (legend("", s.labels) if s.labels else q.expr)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "panel"


def _plot(png: Path, heading: str, lines: list[tuple[PanelQuery, promapi.Series]],
          start: float, scale: Scale) -> None:
    """One figure: every series against seconds since ``start``; "no data" when empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    try:
        ax.set_title(heading)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel(scale.label)
        for q, s in lines:
            ax.plot([t - start for t in s.times], [v * scale.factor for v in s.values],
                    label=_name(q, s), linewidth=1.2)
        if lines:
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                      frameon=False)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", fontsize=20,
                    color="grey", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        fig.savefig(png, bbox_inches="tight")
    finally:
        plt.close(fig)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _index_row(result: PanelResult, lines: list[tuple[PanelQuery, promapi.Series]],
               scale: Scale) -> str:
    counts = ", ".join(f"{ref}: {n}" for ref, n in result.series_counts.items())
    last = "<br>".join(f"{_name(q, s)}: {format_value(_last(s), scale)}"
                       for q, s in lines) or "no data"
    link = f"[{_cell(result.title)}]({result.png.name})"
    return f"| {link} | {result.unit or '-'} | {counts} | {_cell(last)} |"


def _index(heading: str, start: float, end: float, step: float, rows: list[str]) -> str:
    return "\n".join([
        f"# {heading}", "",
        f"Range: {end - start:g} s from unix time {start:.0f}, step {step:g} s.", "",
        "| Panel | Unit | Series per query | Last value |",
        "|---|---|---|---|",
        *rows, "",
    ])
