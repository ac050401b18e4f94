"""Fixtures of the conformance suite: each release's environment (installed by
``mooncake-operator conformance install``; missing, the tests fail with that instruction)
and the probe results for all its cases, computed once per session (an engine's import is
the slow part, so one probe process checks every pod of a release)."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_conformance import runner
from mooncake_conformance.envs import EngineEnv
from mooncake_operator.engines import EngineRelease

from ..needs import missing
from .matrix import RELEASE_IDS, Built, Case, cases, env_of

_CLI: dict[str, dict[str, Any]] = {}


def installed(release: EngineRelease) -> EngineEnv:
    env = env_of(release)
    if not env.ready():
        missing("engines", f"{env.requirement} is not installed: run mooncake-operator "
                           f"conformance install (once; cached afterwards)")
    return env


@pytest.fixture(params=sorted(RELEASE_IDS), scope="session")
def release(request: pytest.FixtureRequest) -> EngineRelease:
    return RELEASE_IDS[request.param]


def cli_results(release: EngineRelease) -> dict[str, tuple[Built, dict[str, Any]]]:
    """Every case of ``release`` through the engine's command line (one probe run)."""
    key = f"{release.kind.value}-{release.version}"
    if key not in _CLI:
        env = installed(release)
        built = [c.build() for c in cases(release)]
        answer = runner.run(env, "cli", {"pods": [b.engine.probe_pod() for b in built]})
        assert answer["ok"], answer
        _CLI[key] = {b.case.id: (b, r) for b, r in zip(built, answer["results"], strict=True)}
    return _CLI[key]


def case_ids(kind: str) -> list[str]:
    return [c.id for r in RELEASE_IDS.values() if r.kind.value == kind for c in cases(r)]


def case_of(case_id: str) -> Case:
    for r in RELEASE_IDS.values():
        for c in cases(r):
            if c.id == case_id:
                return c
    raise KeyError(case_id)
