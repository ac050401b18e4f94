"""Admission rules by name: the look-ups over the registry that :mod:`.base` keeps.

Importing this module imports every rule module once (:mod:`._all`), so each has
registered itself (:func:`.base.register`) before any look-up; the rule modules import
:mod:`.base` only, never this module.
"""

from __future__ import annotations

from ..policies.base import SLOConfig
from . import _all  # noqa: F401  (imports every rule module: each registers itself)
from .base import _REGISTRY, AdmissionConfig, AdmissionRule


def admission_names() -> list[str]:
    """The registered rules' names, sorted."""
    return sorted(_REGISTRY)


def create_admission(config: AdmissionConfig, slo: SLOConfig) -> AdmissionRule:
    """The rule ``config`` names (validated against the registry), configured."""
    return _REGISTRY[config.rule](config, slo)
