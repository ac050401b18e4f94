"""``mooncake-operator monitoring``: scrape-config, rules, render (their error paths too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mooncake_cli.main import main

from ..charts.chartutil import template_text
from .test_rules import ALERTS


def test_scrape_config_from_the_rendered_chart(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rendered = tmp_path / "chart.yaml"
    rendered.write_text(template_text({"metrics": {"serviceMonitor": {"enabled": True},
                                                   "podMonitor": {"enabled": True}}}))
    assert main(["monitoring", "scrape-config", str(rendered), "--role", "pod",
                 "--sd-file", "/tmp/pods.json", "--rule-file", "alerts.yaml"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rule_files"] == ["alerts.yaml"]
    assert len(cfg["scrape_configs"]) == 4  # operator, gateway, engines' two ports
    assert all(j["file_sd_configs"][0]["files"] == ["/tmp/pods.json"]
               for j in cfg["scrape_configs"])


def test_scrape_config_without_monitors_says_what_to_turn_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rendered = tmp_path / "chart.yaml"
    rendered.write_text(template_text({}))
    assert main(["monitoring", "scrape-config", str(rendered)]) == 2
    assert "metrics.serviceMonitor.enabled=true" in capsys.readouterr().err


def test_rules_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitoring", "rules", str(ALERTS), "--speedup", "20"]) == 0
    out = capsys.readouterr().out
    assert "[15s]" in out and "[5m]" not in out
    assert main(["monitoring", "rules", str(ALERTS), "--speedup", "0"]) == 2
    assert "positive" in capsys.readouterr().err


def test_render_without_a_dashboard_file(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitoring", "render", "--prometheus", "http://127.0.0.1:9",
                 "--out", str(tmp_path), "--dashboard", str(tmp_path / "none.json")]) == 2
    assert "no dashboard" in capsys.readouterr().err


def test_render_names_an_unreachable_prometheus(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A Prometheus that is not there: one error line, exit 2 (port 9: discard, closed)."""
    assert main(["monitoring", "render", "--prometheus", "http://127.0.0.1:9",
                 "--since", "1m", "--out", str(tmp_path / "r")]) == 2
    assert "error:" in capsys.readouterr().err
