"""Engine pods' places in the network, from their nodes' topology labels.

Rule: every scheduled engine pod carries :data:`~mooncake_contract.topology.
TOPOLOGY_ANNOTATION`, its node's values of the labels ``spec.topology.levels`` names
(``""`` for a label the node lacks). A pod is labelled once, when it has a node and its
annotation does not yet name every level (new pod, or the levels changed); pods never
move, so only a relabelled node would make an annotation stale, and then only until the
pod is replaced. The gateway reads the annotation (docs/topology.md).

Pure: pods and node labels in, annotation patches out; the reconciler does the reads and
writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mooncake_contract.topology import format_place, parse_place, place_of

from .observe import PodView
from .spec import TopologySpec


def unplaced(pods: Sequence[PodView], topology: TopologySpec) -> list[PodView]:
    """The scheduled, live pods whose annotation does not name every level."""
    keys = topology.node_labels
    if not keys:
        return []
    return [p for p in pods
            if p.node and not p.terminating and not p.finished
            and not parse_place(p.topology_annotation, keys)]


def patches(pods: Sequence[PodView], node_labels: Mapping[str, Mapping[str, str]],
            topology: TopologySpec) -> dict[str, str]:
    """Pod name -> annotation value, for each pod of :func:`unplaced` whose node's labels
    are known (a node that could not be read is left for the next reconcile)."""
    keys = topology.node_labels
    out: dict[str, str] = {}
    for p in unplaced(pods, topology):
        labels = node_labels.get(p.node)
        if labels is not None:
            out[p.name] = format_place(place_of(labels, keys))
    return out
