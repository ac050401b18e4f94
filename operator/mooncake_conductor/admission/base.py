"""The admission interface: a rule by name, its configuration, and the registry's storage
(the look-ups are :mod:`.registry`'s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..policies.base import Placement, SLOConfig
from ..state import ClusterState


class AdmissionConfig(BaseModel):
    """Which rule turns a placed request away for its TTFT SLO, and its option."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str = Field("prediction", description="the admission rule by name "
                      "(prediction: the paper's; current-load: a naive baseline)")
    ttft_miss_risk: float | None = Field(
        None, gt=0, lt=0.5, description="prediction rule only: admit a request only if its "
        "chance of missing the TTFT SLO, from the measured prefill-time prediction error, "
        "is at most this (e.g. 0.01); none: its predicted TTFT against the SLO as is")
    error_of: Literal["prefill", "ttft"] = Field(
        "prefill", description="what each observed prediction error measures, and so how "
        "the margin spreads it: 'prefill', one prefill's own time against its prediction "
        "(the simulator's: the work ahead sums independent errors); 'ttft', a whole "
        "placement-to-answer time against the predicted TTFT (the gateway's: the queue's "
        "errors come measured together, the margin is their quantile on the whole TTFT)")
    error_floor_share: float = Field(
        0.1, gt=0, lt=1, description="error_of 'ttft' only: answers to predictions shorter "
        "than this share of the TTFT SLO do not count toward the measured error (the "
        "margin turns away only predictions near the SLO; short ones carry fixed "
        "overheads that read as large ratios)")

    @model_validator(mode="after")
    def _known_rule(self) -> AdmissionConfig:
        # every rule module has registered by now: importing anything of this package runs
        # its __init__, which imports .registry, which imports every rule module
        if self.rule not in _REGISTRY:
            known = ", ".join(sorted(_REGISTRY))
            raise ValueError(f"unknown admission rule {self.rule!r}; known: {known}")
        if self.ttft_miss_risk is not None and self.rule != "prediction":
            raise ValueError("ttft_miss_risk applies to the prediction rule only")
        return self


class AdmissionRule(ABC):
    """Decides whether a placed request breaks its TTFT SLO (then: rejected, ``ttft-slo``)."""

    name: ClassVar[str] = ""

    def __init__(self, config: AdmissionConfig, slo: SLOConfig) -> None:
        self.config = config
        self.slo = slo

    @abstractmethod
    def breaks_ttft(self, placement: Placement, cluster: ClusterState, now: float,
                    waited: float) -> bool:
        """Whether ``placement`` (made at ``now`` for a request that has already waited
        ``waited`` seconds, held) is to be refused for the TTFT SLO."""

    def observe(self, predicted_s: float, observed_s: float) -> None:  # noqa: B027
        """A prefill predicted to take ``predicted_s`` took ``observed_s`` (rules that
        measure the prediction error use it; the others ignore it)."""

    def measured_error(self) -> dict[str, float | int | bool]:
        """What the rule has learnt of the prediction error, for operators (empty for a
        rule that learns nothing)."""
        return {}


R = TypeVar("R", bound=type[AdmissionRule])
#: every registered rule class by name (filled by :func:`register`, read by :mod:`.registry`)
_REGISTRY: dict[str, type[AdmissionRule]] = {}


def register(cls: R) -> R:
    """Class decorator: enter an admission rule in the registry under its ``name``."""
    if not cls.name:
        raise ValueError("an admission rule needs a name")
    if cls.name in _REGISTRY:
        raise ValueError(f"admission rule {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls
