"""The result envelope and its writer."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from mooncake_testbed.report import envelope, provenance, publish


def test_the_envelope_says_how_the_result_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["x.py", "--repeats", "2"])
    started = time.time() - 5.0
    doc = envelope("x.py", started, {"repeats": 2}, result={"a": 1})
    assert doc["command"] == "python benchmarks/x.py --repeats 2"
    assert doc["started"] == started and 5.0 <= doc["wall_s"] < 60.0
    assert doc["load_end"] >= 0.0
    assert doc["settings"] == {"repeats": 2} and doc["result"] == {"a": 1}


def test_publish_prints_and_writes_what_is_asked(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out, page = tmp_path / "r.json", tmp_path / "r.md"
    publish({"k": [1, 2]}, "# page\n", out, page)
    assert json.loads(out.read_text()) == {"k": [1, 2]}
    assert page.read_text() == "# page\n"
    assert "# page" in capsys.readouterr().out
    other = tmp_path / "other.json"
    publish({"k": 1}, "p", None, None)
    assert not other.exists() and len(list(tmp_path.iterdir())) == 2


def test_provenance_reads_the_envelope() -> None:
    doc = {"command": "python benchmarks/x.py", "started": 0.0, "wall_s": 90.0,
           "load_end": 1.26}
    assert provenance(doc) == ("`python benchmarks/x.py` — 1.5 min on 1970-01-01 00:00 UTC, "
                               "load average 1.3 at the end.")
