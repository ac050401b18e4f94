"""Admission rules: when a placed request is turned away (HTTP 429) for its TTFT SLO.

One rule per module, registered by name (``ConductorConfig.admission_rule``):

- ``prediction`` (default; the paper's early rejection on predicted TTFT, optionally with
  a margin for the prediction error, :mod:`.risk`);
- ``current-load`` (a naive rule on the chosen instance's current queue alone, the
  baseline of the paper's Table 3).

The rule applies only where admission is on (``ConductorConfig.admission`` or the
policy's default). The decode side's refusal (``tbt-slo``) is the decode selector's.
"""

from .base import AdmissionConfig, AdmissionRule, register
from .registry import admission_names, create_admission

__all__ = ["AdmissionConfig", "AdmissionRule", "admission_names", "create_admission",
           "register"]
