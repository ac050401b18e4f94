"""Prints the end-to-end scenarios' measurements at the end of the run (also in CI, where
output is captured)."""

from __future__ import annotations

from typing import Any

from .e2e_fixtures import REPORTS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORTS:
        terminalreporter.section("operator end-to-end scenarios")
        for line in REPORTS:
            terminalreporter.write_line(line)
