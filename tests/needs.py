"""What a test needs from outside Python, and what happens when it is missing.

A test that needs an external program (``mooncake_master``, kubectl, helm, mount namespaces,
...) FAILS with a one-line instruction when it is missing: nothing skips silently. A user
who cannot install it opts out explicitly, by name, with ``MOONCAKE_TESTS_WITHOUT``
(comma-separated, e.g. ``MOONCAKE_TESTS_WITHOUT=store,helm``); those tests then show as
skipped with the reason. Deselecting a marker (``-m "not store"``) is the other explicit way.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

OPT_OUT_ENV = "MOONCAKE_TESTS_WITHOUT"

#: Every name a test may need; an opt-out outside this list is an error, not a silent no-op.
KNOWN = {
    "store": "a real mooncake_master (the Mooncake Store wheel)",
    "kubectl": "the kubectl binary",
    "helm": "the helm binary built by local-cluster build",
    "mountns": "mount namespaces (unshare --mount)",
    "port443": "binding port 443 (root, or a low ip_unprivileged_port_start)",
    "engines": "vLLM and SGLang from PyPI (mooncake-operator conformance install)",
    "prometheus": "the prometheus and promtool binaries (apt-get install prometheus)",
    "cc": "a C compiler (cc, gcc or clang) for the embedded cluster's bind pin",
}


def opted_out() -> set[str]:
    names = {n.strip() for n in os.environ.get(OPT_OUT_ENV, "").split(",") if n.strip()}
    unknown = names - set(KNOWN)
    if unknown:
        pytest.fail(f"{OPT_OUT_ENV} names unknown requirement(s) {sorted(unknown)}; "
                    f"known: {', '.join(sorted(KNOWN))}", pytrace=False)
    return names


def missing(name: str, instruction: str) -> NoReturn:
    """Fail with ``instruction`` (one line), or skip when the user opted out of ``name``."""
    if name not in KNOWN:
        raise ValueError(f"unknown requirement {name!r}")
    if name in opted_out():
        pytest.skip(f"{instruction} [{OPT_OUT_ENV}={name}]")
    pytest.fail(f"{instruction} -- or opt out: {OPT_OUT_ENV}={name}", pytrace=False)
