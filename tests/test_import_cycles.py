"""No import circles anywhere: among the modules of every top-level package, no module
imports (directly or through others) a module that imports it back. Every import counts,
including those inside functions (a deferred import hides a circle from Python's loader,
not from the design); the package a submodule sits in is not an import of it."""

from __future__ import annotations

import tomllib
from itertools import pairwise
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.name for folder in ("operator", "worker")
                  for p in (ROOT / folder).glob("mooncake_*") if (p / "__init__.py").is_file())


def knots(graph: grimp.ImportGraph) -> list[tuple[list[str], list[str]]]:
    """Each group of modules that import one another (through others or not): a shortest
    circle in it, as the modules in import order with the first repeated at the end
    (``[a, b, a]``: ``a`` imports ``b``, ``b`` imports ``a``), and all its modules,
    sorted. Empty when there is none."""
    found: list[tuple[list[str], list[str]]] = []
    seen: set[str] = set()
    for importer in sorted(graph.modules):
        if importer in seen:
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            chain = graph.find_shortest_chain(importer=imported, imported=importer)
            if chain is not None:  # imported leads back to importer
                group = {importer} | (graph.find_upstream_modules(importer)
                                      & graph.find_downstream_modules(importer))
                seen |= group
                found.append(([importer, *chain], sorted(group)))
                break
    return found


def _describe(graph: grimp.ImportGraph, circle: list[str], group: list[str]) -> str:
    lines = [" -> ".join(circle)]
    for importer, imported in pairwise(circle):
        for d in graph.get_import_details(importer=importer, imported=imported):
            lines.append(f"    {d['importer']}:{d['line_number']}: {d['line_contents']}")
    if len(group) > len(circle) - 1:
        lines.append(f"    (the {len(group)} modules tied together: {', '.join(group)})")
    return "\n".join(lines)


def test_the_packages_are_all_there() -> None:
    linted = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert set(PACKAGES) == set(linted["tool"]["importlinter"]["root_packages"])
    assert {"mooncake_conductor", "mooncake_gateway", "mooncake_worker"} <= set(PACKAGES)


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    found = knots(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(graph, *k) for k in found)


def test_a_planted_circle_is_found_and_printed() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"),
                               ("p.c", "p.d"), ("p.e", "p.d")]:
        graph.add_import(importer=importer, imported=imported, line_number=1,
                         line_contents=f"from . import {imported[2:]}")
    assert knots(graph) == [(["p.a", "p.b", "p.c", "p.a"], ["p.a", "p.b", "p.c"])]
    assert _describe(graph, *knots(graph)[0]).splitlines() == [
        "p.a -> p.b -> p.c -> p.a",
        "    p.a:1: from . import b",
        "    p.b:1: from . import c",
        "    p.c:1: from . import a",
    ]
