"""Prefill scheduling policies, one per module, registered by name."""

from .base import Placement, PolicyContext, PrefillPolicy, SLOConfig
from .registry import create_policy, policy_class, policy_names

__all__ = [
    "Placement",
    "PolicyContext",
    "PrefillPolicy",
    "SLOConfig",
    "create_policy",
    "policy_class",
    "policy_names",
]
