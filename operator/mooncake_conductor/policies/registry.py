"""Prefill policies by name: the look-ups over the registry that :mod:`.base` keeps.

Importing this module imports every policy module once (:mod:`._all`), so each has
registered itself (:func:`.base.register`) before any look-up; the policy modules import
:mod:`.base` only, never this module.
"""

from __future__ import annotations

from typing import Any

from . import _all  # noqa: F401  (imports every policy module: each registers itself)
from .base import _REGISTRY, PolicyContext, PrefillPolicy


def policy_names() -> list[str]:
    """The registered policies' names, sorted."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[PrefillPolicy]:
    """The policy class registered as ``name`` (``KeyError`` naming the known ones)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def create_policy(
    name: str, ctx: PolicyContext, params: dict[str, Any] | None = None
) -> PrefillPolicy:
    """Instantiate a registered policy by name with validated parameters."""
    cls = policy_class(name)
    return cls(cls.Params.model_validate(params or {}), ctx)
