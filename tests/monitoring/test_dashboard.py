"""The chart's Grafana dashboard: variables substituted, legends, units, and PNG rendering."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.figure
import pytest
from mooncake_monitoring import dashboard, promapi
from mooncake_monitoring.dashboard import Scale, legend, panel_queries, render, unit_scale

from tests.monitoring.test_promapi import NOW, FakePrometheus, matrix

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEP = 5.0
END = NOW + 60


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return dashboard.load_dashboard()


def timeseries(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The timeseries panels, counted independently of the code under test."""
    found = []
    for p in board["panels"]:
        found += [p] if p["type"] == "timeseries" else []
        found += [c for c in p.get("panels", []) if c["type"] == "timeseries"]
    return found


def one_panel(expr: str, unit: str = "short", title: str = "P") -> dict[str, Any]:
    return {"panels": [{"type": "timeseries", "title": title,
                        "fieldConfig": {"defaults": {"unit": unit}},
                        "targets": [{"refId": "A", "expr": expr, "legendFormat": "{{x}}"}]}]}


def by_labels(expr: str) -> list[str]:
    """The labels of the expression's first ``by (...)``, ``le`` left out (quantiles drop it)."""
    m = re.search(r"by \(([^)]*)\)", expr)
    names = [n.strip() for n in m[1].split(",")] if m else []
    return [n for n in names if n != "le"]


def plausible(expr: str) -> dict[str, Any]:
    """Two series per query, labelled by its ``by`` clause; values shaped like the metric."""
    if "_seconds" in expr:
        values = ["0.012", "0.05", "NaN", "0.2"]  # latencies under one second
    elif " / " in expr:
        values = ["0.25", "0.5", "0.75", "0.6"]  # ratios
    else:
        values = ["1", "4", "2", "8"]
    labels = by_labels(expr)
    return matrix(*[({n: f"{n}-{i}" for n in labels}, values) for i in (1, 2)], start=NOW)


@pytest.fixture
def fake() -> Iterator[FakePrometheus]:
    with FakePrometheus() as prom:
        prom.range = plausible
        yield prom


# --- variables ----------------------------------------------------------------------------


def test_every_target_of_the_real_dashboard_is_substituted(board: dict[str, Any]) -> None:
    panels = timeseries(board)
    queries = panel_queries(board)
    assert len(queries) == sum(len(p["targets"]) for p in panels) > 10
    assert [q.panel for q in queries] == [p["title"] for p in panels for _ in p["targets"]]
    for q in queries:
        assert "$" not in q.expr, q
        assert q.ref and q.unit
    assert sum('model=~".*"' in q.expr for q in queries) >= 10
    assert sum("[1m]" in q.expr for q in queries) >= 10
    ttft = next(q for q in queries if q.panel == "Time to first token" and q.ref == "C")
    assert ttft.legend == "p99 {{model}}"
    assert ttft.unit == "s"
    assert ttft.expr.startswith("histogram_quantile(0.99, ")


def test_model_and_rate_interval_are_the_callers(board: dict[str, Any]) -> None:
    queries = panel_queries(board, model="llama|qwen", rate_interval="30s")
    exprs = " ".join(q.expr for q in queries)
    assert 'model=~"llama|qwen"' in exprs
    assert "[30s]" in exprs
    assert "[1m]" not in exprs and ".*" not in exprs


def test_braced_forms_interval_and_collapsed_rows() -> None:
    board = {"panels": [
        {"type": "row", "title": "folded", "collapsed": True, "panels": [
            one_panel('rate(x{model=~"${model}"}[$__interval])', title="nested")["panels"][0]]},
        {"type": "stat", "title": "not a timeseries",
         "targets": [{"refId": "A", "expr": "up{model=~\"$model\"}"}]},
        one_panel('sum(rate(y{m=~"${model:regex}"}[${__rate_interval}]))')["panels"][0],
    ]}
    got = [(q.panel, q.expr) for q in panel_queries(board, model="a", rate_interval="2m")]
    assert got == [("nested", 'rate(x{model=~"a"}[2m])'), ("P", 'sum(rate(y{m=~"a"}[2m]))')]


def test_unknown_variable_raises_naming_it(board: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"\$cluster") as info:
        panel_queries(one_panel('up{cluster="$cluster"}', title="Pods"))
    assert "Pods" in str(info.value)
    spoiled = copy.deepcopy(board)
    timeseries(spoiled)[-1]["targets"][0]["expr"] += " * ${namespace}"
    with pytest.raises(ValueError, match=r"\$namespace"):
        panel_queries(spoiled)


def test_regex_anchor_dollar_is_not_a_variable() -> None:
    (q,) = panel_queries(one_panel('up{pod=~"gw-.*$"}'))
    assert q.expr == 'up{pod=~"gw-.*$"}'


# --- legends and units ----------------------------------------------------------------------


def test_legend_fills_labels_like_grafana() -> None:
    labels = {"model": "llama", "outcome": "ok"}
    assert legend("p50 {{model}}", labels) == "p50 llama"
    assert legend("{{ model }} {{outcome}}", labels) == "llama ok"
    assert legend("{{role}} x", labels) == " x"  # an absent label is empty, as in Grafana
    assert legend("static", labels) == "static"
    assert legend("", labels) == '{model="llama", outcome="ok"}'


@pytest.mark.parametrize(("unit", "peak", "factor", "label"), [
    ("s", 0.25, 1000.0, "milliseconds"),
    ("s", 0.999, 1000.0, "milliseconds"),
    ("s", 1.0, 1.0, "seconds"),
    ("s", 12.0, 1.0, "seconds"),
    ("percentunit", 0.5, 100.0, "%"),
    ("reqps", 3.0, 1.0, "requests/s"),
    ("ops", 3.0, 1.0, "per second"),
    ("short", 3.0, 1.0, ""),
    ("", 3.0, 1.0, ""),
])
def test_unit_scale(unit: str, peak: float, factor: float, label: str) -> None:
    scale = unit_scale(unit, peak)
    assert (scale.factor, scale.label) == (factor, label)


def test_format_value() -> None:
    assert dashboard.format_value(0.0123, unit_scale("s", 0.5)) == "12.3 ms"
    assert dashboard.format_value(2.5, unit_scale("s", 2.5)) == "2.5 s"
    assert dashboard.format_value(0.425, unit_scale("percentunit", 1)) == "42.5%"
    assert dashboard.format_value(7, unit_scale("short", 7)) == "7"
    assert dashboard.format_value(float("nan"), Scale(1, "", "")) == "NaN"


# --- rendering ----------------------------------------------------------------------------


@dataclass
class Rendered:
    """One render() of the real dashboard, with what each figure held when it was saved."""

    report: dashboard.Report
    requests: list[tuple[str, dict[str, str]]]
    figures: dict[str, dict[str, Any]]


def describe(fig: matplotlib.figure.Figure) -> dict[str, Any]:
    ax = fig.axes[0]
    box = ax.get_legend()
    return {
        "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
        "lines": [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata()))
                  for ln in ax.get_lines()],
        "legend": [t.get_text() for t in box.get_texts()] if box else [],
        "texts": [t.get_text() for t in ax.texts],
    }


def spy_on_figures(mp: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Record every figure (by axes title) as render() saves it."""
    seen: dict[str, dict[str, Any]] = {}
    original = matplotlib.figure.Figure.savefig

    def spy(fig: matplotlib.figure.Figure, *args: Any, **kwargs: Any) -> None:
        seen[fig.axes[0].get_title()] = describe(fig)
        original(fig, *args, **kwargs)

    mp.setattr(matplotlib.figure.Figure, "savefig", spy)
    return seen


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rendered]:
    out = tmp_path_factory.mktemp("render") / "out"
    with FakePrometheus() as prom, pytest.MonkeyPatch.context() as mp:
        prom.range = plausible
        figures = spy_on_figures(mp)
        report = render(prom.url, NOW, END, out, step=STEP, title="Drill 7")
        yield Rendered(report, prom.requests, figures)


def test_render_writes_one_png_per_panel(rendered: Rendered, board: dict[str, Any]) -> None:
    report, panels = rendered.report, timeseries(board)
    assert [p.title for p in report.panels] == [p["title"] for p in panels]
    assert report.empty() == []
    for n, (result, panel) in enumerate(zip(report.panels, panels, strict=True), start=1):
        assert result.png.parent == report.index.parent
        assert re.fullmatch(rf"{n:02d}-[a-z0-9-]+\.png", result.png.name)
        assert result.png.read_bytes()[:8] == PNG_MAGIC
        assert result.series_counts == {t["refId"]: 2 for t in panel["targets"]}
        assert result.unit == panel["fieldConfig"]["defaults"]["unit"]
    assert report.panels[0].png.name == "01-time-to-first-token.png"
    assert sorted(report.index.parent.glob("*.png")) == [p.png for p in report.panels]


def test_render_queries_prometheus_with_substituted_exprs(
        rendered: Rendered, board: dict[str, Any]) -> None:
    ranges = [params for path, params in rendered.requests if path == "/api/v1/query_range"]
    assert [p["query"] for p in ranges] == [q.expr for q in panel_queries(board)]
    for params in ranges:
        assert (float(params["start"]), float(params["end"]), float(params["step"])) == \
            (NOW, END, STEP)


def test_index_lists_every_panel_with_last_values_in_its_unit(rendered: Rendered) -> None:
    text = rendered.report.index.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Drill 7"
    for result in rendered.report.panels:
        assert sum(f"| [{result.title}]({result.png.name}) |" in r for r in lines) == 1
    ttft = next(r for r in lines if "[Time to first token]" in r)
    assert "| s | A: 2, B: 2, C: 2 |" in ttft
    assert "p50 model-1: 200 ms" in ttft  # the last sample, 0.2 s, in milliseconds
    ratio = next(r for r in lines if "[Prefix hit ratio]" in r)
    assert "predicted model-2: 60%" in ratio
    requests = next(r for r in lines if "[Requests]" in r)
    assert "model-1 outcome-1: 8 req/s" in requests


def test_figures_plot_seconds_since_start_with_scaled_values(rendered: Rendered) -> None:
    seen = rendered.figures
    assert set(seen) == {"Drill 7: " + p.title for p in rendered.report.panels}
    ttft = seen["Drill 7: Time to first token"]
    assert ttft["xlabel"] == "seconds since start"
    assert ttft["ylabel"] == "milliseconds"
    label, xs, ys = ttft["lines"][0]
    assert label == "p50 model-1"
    assert xs == [0.0, 5.0, 10.0, 15.0]
    assert ys[:2] == pytest.approx([12.0, 50.0]) and ys[3] == pytest.approx(200.0)
    assert ttft["legend"] == [f"p{q} model-{i}" for q in (50, 90, 99) for i in (1, 2)]
    assert seen["Drill 7: Prefix hit ratio"]["ylabel"] == "%"
    assert seen["Drill 7: Prefix hit ratio"]["lines"][0][2] == pytest.approx([25, 50, 75, 60])
    assert seen["Drill 7: Requests"]["ylabel"] == "requests/s"
    assert seen["Drill 7: Reconciles"]["ylabel"] == "per second"
    assert seen["Drill 7: Blocks in the index"]["ylabel"] == ""
    assert all(f["texts"] == [] for f in seen.values())


def test_seconds_panel_over_one_second_stays_in_seconds(
        fake: FakePrometheus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.range = lambda expr: matrix(({"x": "slow"}, ["0.5", "2.5", "NaN"]), start=NOW)
    seen = spy_on_figures(monkeypatch)
    report = render(fake.url, NOW, END, tmp_path, dashboard=one_panel("wait", unit="s"))
    assert seen["P"]["ylabel"] == "seconds"
    assert seen["P"]["lines"][0][2][:2] == pytest.approx([0.5, 2.5])
    assert "slow: 2.5 s" in report.index.read_text()  # the last value that is not NaN


def test_panel_without_data_still_gets_a_png(
        fake: FakePrometheus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    board = {"panels": [one_panel("up", title="Has data")["panels"][0],
                        one_panel("absent_metric", title="Empty")["panels"][0]]}
    fake.range = lambda expr: matrix() if expr == "absent_metric" else plausible(expr)
    seen = spy_on_figures(monkeypatch)
    report = render(fake.url, NOW, END, tmp_path, dashboard=board)
    assert report.empty() == ["Empty [A]"]
    empty = report.panels[1]
    assert (empty.png.name, empty.series_counts) == ("02-empty.png", {"A": 0})
    assert empty.png.read_bytes()[:8] == PNG_MAGIC
    assert seen["Empty"]["texts"] == ["no data"] and seen["Empty"]["lines"] == []
    assert seen["Has data"]["texts"] == []
    assert seen["Has data"]["legend"] == ["up", "up"]  # "{{x}}" came out blank: the expr
    row = next(r for r in report.index.read_text().splitlines() if "[Empty]" in r)
    assert row.endswith("| A: 0 | no data |")


def test_render_names_the_panel_when_prometheus_refuses(
        fake: FakePrometheus, board: dict[str, Any], tmp_path: Path) -> None:
    bad = next(q for q in panel_queries(board) if q.panel == "Requests")
    fake.errors[bad.expr] = (422, "execution", "many-to-many matching not allowed")
    with pytest.raises(promapi.PromError, match=r"'Requests' \[A\].*many-to-many") as info:
        render(fake.url, NOW, END, tmp_path)
    assert info.value.status == 422
