"""The alert rules' clock compression (mooncake_monitoring.rules)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from mooncake_monitoring.rules import compress, compress_expr, duration, seconds

from tests.needs import missing

ALERTS = Path(__file__).resolve().parents[2] / "charts/mooncake-operator/files/alerts.yaml"


@pytest.mark.parametrize(("text", "secs"), [("5m", 300), ("1h30m", 5400), ("90s", 90),
                                            ("1d", 86400), ("250ms", 0.25)])
def test_seconds(text: str, secs: float) -> None:
    assert seconds(text) == secs


@pytest.mark.parametrize("bad", ["", "5", "m5", "5 m", "1.5h"])
def test_seconds_refuses_what_prometheus_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        seconds(bad)


@pytest.mark.parametrize(("secs", "text"), [(15, "15s"), (90, "1m30s"), (3600, "1h"),
                                            (0.2, "1s"), (7322, "2h2m2s")])
def test_duration(secs: float, text: str) -> None:
    assert duration(secs) == text


def test_windows_shrink_and_nothing_else_changes() -> None:
    expr = ('sum by (model) (rate(x_total{le="0.5",a=~"[0-9]+"}[5m])) / '
            'sum(rate(y[1h])) > (14.4 * 0.01) and max_over_time(z[30m:1m]) > 0 '
            'and max_over_time(w[10m:]) > 0')
    assert compress_expr(expr, 20) == (
        'sum by (model) (rate(x_total{le="0.5",a=~"[0-9]+"}[15s])) / '
        'sum(rate(y[3m])) > (14.4 * 0.01) and max_over_time(z[1m30s:3s]) > 0 '
        'and max_over_time(w[30s:]) > 0')


def test_compress_keeps_the_rules_and_scales_for() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    fast = compress(rules, 20)
    before = [r for g in rules["groups"] for r in g["rules"]]
    after = [r for g in fast["groups"] for r in g["rules"]]
    assert [r.get("alert") or r.get("record") for r in after] == \
        [r.get("alert") or r.get("record") for r in before]
    for b, a in zip(before, after, strict=True):
        assert a.get("labels") == b.get("labels") and a.get("annotations") == b.get("annotations")
        if "for" in b:
            assert seconds(a["for"]) == max(1, round(seconds(b["for"]) / 20))
    assert rules == yaml.safe_load(ALERTS.read_text()), "the input was modified"
    with pytest.raises(ValueError):
        compress(rules, 0)


def test_compressed_rules_are_valid_for_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("prometheus", "promtool not found: apt-get install prometheus")
    out = tmp_path / "fast.yaml"
    out.write_text(yaml.safe_dump(compress(yaml.safe_load(ALERTS.read_text()), 20)))
    proc = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
