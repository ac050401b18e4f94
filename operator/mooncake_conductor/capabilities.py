"""What a Conductor does beyond placing a request, composed once from its configuration.

Rule: a policy declares the capabilities it is published with (its class's
:attr:`~.policies.base.PrefillPolicy.capabilities`); every switch of
:class:`~.engine.ConductorConfig` that is set overrides the policy's own, and an unset
one (``None``) keeps it. Then the dependencies apply:

- ``routing_only`` (equal capability: every policy routes on local caches only) turns
  off admission, stealing and replication;
- shedding and holding are admission rules: without admission they are off;
- holding is on by default only with a decode selector that counts the requests placed
  on an instance whose prefill still runs: requests released together after a hold
  would otherwise all see the same free room and pile onto it.

Calibration and re-estimation are not decisions, so ``routing_only`` keeps them.
Sources: admission, the paper's §4 ("reject at once"); the rest, docs/conductor.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Capabilities:
    """One switch per capability; a policy's class holds its published defaults."""

    #: predicted SLO misses are rejected (HTTP 429) before any work is done
    admission: bool = False
    #: with admission, costly requests are shed under overload (:mod:`.shedding`)
    shedding: bool = False
    #: an idle prefill instance takes prompts queued on others (:mod:`.stealing`)
    stealing: bool = False
    #: with admission, requests refused for decode room wait for it (:mod:`.holding`)
    holding: bool = False
    #: hot prefixes are replicated ahead of need (:mod:`.replication`)
    replication: bool = False
    #: the prefill-time model is calibrated online from observed durations
    calibration: bool = False
    #: a prefill still running past its predicted end is re-estimated (:mod:`.overrun`)
    reestimation: bool = False

    def on(self) -> list[str]:
        """The names of the capabilities that are on, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name)]


@dataclass(frozen=True, slots=True)
class Overrides:
    """The configuration's switches: ``None`` keeps the policy's own default."""

    admission: bool | None = None
    shedding: bool | None = None
    stealing: bool | None = None
    holding: bool | None = None
    replication: bool | None = None
    calibration: bool | None = None
    reestimation: bool | None = None


def compose(own: Capabilities, overrides: Overrides, *, routing_only: bool,
            decode_counts_placed: bool) -> Capabilities:
    """The capabilities a Conductor runs with (the module's rule)."""
    def pick(name: str, default: bool) -> bool:
        setting: bool | None = getattr(overrides, name)
        return default if setting is None else setting

    admission = not routing_only and pick("admission", own.admission)
    return Capabilities(
        admission=admission,
        shedding=admission and pick("shedding", own.shedding),
        stealing=not routing_only and pick("stealing", own.stealing),
        holding=admission and pick("holding", own.holding and decode_counts_placed),
        replication=not routing_only and pick("replication", own.replication),
        calibration=pick("calibration", own.calibration),
        reestimation=pick("reestimation", own.reestimation),
    )
