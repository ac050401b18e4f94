"""The user pages stay true to the code: every policy and its knobs on the policies page,
every status reason and gateway error code on the troubleshooting page (read from the
source, so a new one fails here until it is documented), the architecture picture in
place, and relative links that resolve."""

from __future__ import annotations

import ast
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from mooncake_conductor.decode import DECODE_SELECTORS
from mooncake_conductor.policies.registry import policy_class, policy_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = ("architecture.md", "policies.md", "troubleshooting.md", "real-cluster.md",
         "reference.md", "status.md")
#: pages outside docs/ or below it, each read relative to its own folder
INDEXES = (ROOT / "README.md", DOCS / "results" / "README.md")
#: pages written on other branches (the Helm chart's): links to them may wait
PENDING = {"helm.md"}


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^##)", text + "\n##", re.M | re.S)
    assert match, f"no section {heading}"
    return match.group(1)


# -- policies -------------------------------------------------------------------------
@pytest.mark.parametrize("name", policy_names())
def test_every_policy_has_its_section_with_each_knob(name: str) -> None:
    text = _page("policies.md")
    body = _section(text, f"`{name}`")
    for label in ("**Rule.**", "**Source.**", "**Parameters.**", "**When.**"):
        assert label in body, (name, label)
    for knob in policy_class(name).Params.model_fields:
        assert f"`{knob}`" in body, f"{name}: parameter {knob} not described"
    assert f"| `{name}` |" in text, f"{name} missing from the table"


def test_every_decode_selector_is_described() -> None:
    text = _page("policies.md")
    for name in DECODE_SELECTORS:
        assert f"`{name}`" in text.split("## Decode selectors", 1)[1], name


# -- troubleshooting ------------------------------------------------------------------
def _strings(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Tuple):
        return [n for t in target.elts for n in _target_names(t)]
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute):
        return [target.attr]
    return []


def _assigned(tree: ast.AST, names: set[str]) -> set[str]:
    """String constants assigned to a variable or attribute of one of ``names`` (for a
    tuple assignment, the value in the same position)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=False))
            else:
                pairs = [(target, node.value)]
            for t, v in pairs:
                if set(_target_names(t)) & names:
                    out |= set(_strings(v))
    return out


def _calls(tree: ast.AST, func: str) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == func) or (
                    isinstance(f, ast.Attribute) and f.attr == func):
                yield node


def _trees(folder: str) -> list[ast.AST]:
    return [ast.parse(p.read_text(encoding="utf-8"))
            for p in sorted((ROOT / "operator" / folder).rglob("*.py"))]


def status_reasons() -> set[str]:
    out: set[str] = set()
    for tree in _trees("mooncake_operator"):
        for call in _calls(tree, "Problem"):
            out |= {a.value for a in call.args[:1] if isinstance(a, ast.Constant)}
        out |= _assigned(tree, {"ready_reason", "prog_reason", "activity"})
    return {s for s in out if re.fullmatch(r"[A-Z][A-Za-z]+", s)}


def gateway_codes() -> set[str]:
    out: set[str] = set()
    for tree in _trees("mooncake_gateway"):
        for call in _calls(tree, "ApiError"):
            if len(call.args) >= 4 and isinstance(call.args[3], ast.Constant):
                out.add(call.args[3].value)
            for kw in call.keywords:
                if kw.arg == "code":
                    out |= set(_strings(kw.value))
        out |= _assigned(tree, {"code"})
    for tree in _trees("mooncake_conductor"):
        reasons = _assigned(tree, {"reject_reason"})
        for call in ast.walk(tree):
            if isinstance(call, ast.Call):
                for kw in call.keywords:
                    if kw.arg == "reject_reason":
                        reasons |= set(_strings(kw.value))
        out |= {r.replace("-", "_") for r in reasons}  # as the gateway sends them
    return {s for s in out if re.fullmatch(r"[a-z][a-z_]+", s)}


def test_reasons_and_codes_are_found_in_the_source() -> None:
    assert {"InvalidSpec", "ServedNameConflict", "EngineCrashLooping", "StoreDegraded",
            "GatewayUnreachable", "WaitingForStore", "Creating", "Stalled"} <= status_reasons()
    assert {"model_not_found", "upstream_failed", "ttft_slo", "tbt_slo",
            "no_prefill_instance", "request_too_large"} <= gateway_codes()


def test_every_status_reason_is_explained() -> None:
    text = _page("troubleshooting.md")
    missing = sorted(r for r in status_reasons() if f"`{r}`" not in text)
    assert not missing, f"troubleshooting.md does not explain {missing}"


def test_every_gateway_error_code_is_explained() -> None:
    text = _page("troubleshooting.md")
    missing = sorted(c for c in gateway_codes() if f"`{c}`" not in text)
    assert not missing, f"troubleshooting.md does not explain {missing}"


# -- architecture and links -----------------------------------------------------------
def test_architecture_picture() -> None:
    assert "](architecture.svg)" in _page("architecture.md")
    svg = ET.parse(DOCS / "architecture.svg").getroot()
    assert svg.tag.endswith("svg")
    text = " ".join(t.text or "" for t in svg.iter() if t.tag.endswith(("text", "title")))
    for part in ("gateway", "prefill pool", "decode pool", "Mooncake", "operator (kopf)",
                 "KV events", "MooncakeCluster"):
        assert part in text, part


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page: str) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _page(page)):
        if "://" in target or target in PENDING:
            continue
        assert (DOCS / target).exists(), f"{page} links to {target}"


@pytest.mark.parametrize("page", INDEXES, ids=lambda p: str(p.relative_to(ROOT)))
def test_index_links_resolve(page: Path) -> None:
    """The README and the results index link to pages that exist (one broken link
    planted in a copy is found, so the pattern reads these tables)."""
    text = page.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(targets) >= 5
    for target in targets:
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}"
    planted = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text + "\n[gone](no-such-page.md)")
    assert not all((page.parent / t).exists() for t in planted if "://" not in t)
