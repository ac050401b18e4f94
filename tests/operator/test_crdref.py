"""docs/reference.md is rendered from the CRD: the committed page matches, every field
path of the schema is on it with its default and constraints, every CEL rule too, and a
schema keyword the renderer does not know fails instead of vanishing."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from mooncake_cli.main import main as cli_main
from mooncake_operator import crd, crdref

ROOT = Path(__file__).resolve().parents[2]


def _schema(doc: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = doc or crd.crd()
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _fields(node: dict[str, Any], path: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(section path, field name, field schema) of every field below ``node``."""
    out = []
    for name, sub in (node.get("properties") or {}).items():
        out.append((path, name, sub))
        out += _fields(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _fields(node["items"], f"{path}[]")
    return out


def _section(text: str, path: str) -> str:
    match = re.search(rf"^### {re.escape(path)}\n(.*?)(?=^##)", text + "\n##", re.M | re.S)
    assert match, f"no section {path}"
    return match.group(1)


def test_committed_reference_matches_the_crd() -> None:
    committed = (ROOT / crdref.REFERENCE_FILE).read_text(encoding="utf-8")
    assert committed == crdref.render(), \
        "run `mooncake-operator operator crd --reference --write`"


def test_cli_check_and_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["operator", "crd", "--reference", "--check"]) == 0
    stale = tmp_path / "reference.md"
    stale.write_text(crdref.render().replace("Length ≤ 40.", "Length ≤ 41."), encoding="utf-8")
    assert crdref.main(["--check", "--path", str(stale)]) == 1
    assert "--reference --write" in capsys.readouterr().err
    assert crdref.main(["--write", "--path", str(stale)]) == 0
    assert crdref.main(["--check", "--path", str(stale)]) == 0


def test_every_field_with_its_default_and_description() -> None:
    text = crdref.render()
    root = _schema()
    for part in ("metadata", "spec", "status"):
        for section, name, sub in _fields(root["properties"][part], part):
            body = _section(text, section)
            row = next((ln for ln in body.splitlines() if ln.startswith(f"| `{name}` |")), None)
            assert row is not None, f"{section}.{name} missing"
            cells = row.split(" | ")
            if "default" in sub:
                assert cells[2].strip(), f"{section}.{name}: no default shown"
            words = str(sub.get("description", "")).split()[:4]
            assert " ".join(words) in row.replace("\\|", "|"), f"{section}.{name}"
            for value in sub.get("enum", []):
                assert f"`{value}`" in row, (section, name, value)
            if "maximum" in sub:
                assert f" {sub['maximum']}" in row, (section, name)


def test_every_cel_rule_is_listed_with_its_field() -> None:
    text = crdref.render().replace("\\|", "|")
    rules = []

    def walk(node: dict[str, Any]) -> None:
        rules.extend(node.get("x-kubernetes-validations") or [])
        for sub in (node.get("properties") or {}).values():
            walk(sub)
        if isinstance(node.get("items"), dict):
            walk(node["items"])

    walk(_schema())
    assert len(rules) >= 8
    for rule in rules:
        assert f"`{rule['rule']}`" in text, rule["rule"]
        assert rule["message"] in text
    assert "| `spec.store.segmentSize` | `quantity(self.segmentSize)" in text


def test_sections_link_and_anchors_are_unique() -> None:
    text = crdref.render()
    headings = re.findall(r"^### (.+)$", text, re.M)
    anchors = {crdref.anchor(h) for h in headings}
    assert len(anchors) == len(headings)
    for target in re.findall(r"\]\(#([^)]+)\)", text):
        assert target in anchors, target


def test_unknown_schema_keyword_fails() -> None:
    doc = copy.deepcopy(crd.crd())
    _schema(doc)["properties"]["spec"]["properties"]["model"]["properties"]["name"][
        "format"] = "hostname"
    with pytest.raises(ValueError, match="format"):
        crdref.render(doc)
