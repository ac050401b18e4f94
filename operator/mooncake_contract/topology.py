"""The pod-annotation contract for an engine's place in the network topology.

The operator reads the node labels that ``spec.topology.levels`` names off the node a pod
runs on and writes them on the pod as :data:`TOPOLOGY_ANNOTATION`; the gateway reads the
annotation into the Conductor, which charges KV transfers by the coarsest level at which
two places differ.

Annotation value: a JSON object from each level's node label to the node's value of it,
e.g. ``{"nvidia.com/gpu.clique": "nvl-3", "topology.kubernetes.io/zone": "us-east-1a"}``.
A node without one of the labels gives ``""`` for it. Readers take the values in their own
order of levels (finest first); a pod whose annotation lacks one of the levels (written
before the levels changed), is unreadable, or is missing has no place, and the Conductor
treats it as near every other pod: today's flat model.

Writers use :func:`format_place`; readers :func:`parse_place`, or :func:`parse_labels`
then :func:`place_values` when the levels are known only later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .conventions import ANNOTATION_TOPOLOGY

#: Pod annotation with the pod's place (JSON object: node label -> value).
TOPOLOGY_ANNOTATION = ANNOTATION_TOPOLOGY
#: Most levels a place has (NVLink domain, rack, block, zone, region, and one spare).
MAX_LEVELS = 6


def place_of(node_labels: Mapping[str, str], keys: Sequence[str]) -> dict[str, str]:
    """The place of a pod on a node with ``node_labels``: each key of ``keys`` and the
    node's value of it (``""`` where the node lacks the label)."""
    return {k: node_labels.get(k, "") for k in keys}


def format_place(place: Mapping[str, str]) -> str:
    """The annotation value for ``place`` (compact JSON, keys sorted: one text per place)."""
    if len(place) > MAX_LEVELS:
        raise ValueError(f"a place has at most {MAX_LEVELS} levels, got {len(place)}")
    return json.dumps(dict(place), separators=(",", ":"), sort_keys=True)


def parse_labels(value: str) -> dict[str, str] | None:
    """The labels an annotation value names; ``None`` when it is not a JSON object of
    strings."""
    try:
        data = json.loads(value)
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        return None
    return data


def place_values(labels: Mapping[str, str], keys: Sequence[str]) -> tuple[str, ...]:
    """The values of ``keys`` in their order; ``()`` (no place) when ``keys`` is empty or
    ``labels`` lacks one of them (an annotation written before the levels changed)."""
    if not keys or not all(k in labels for k in keys):
        return ()
    return tuple(labels[k] for k in keys)


def parse_place(value: str | None, keys: Sequence[str]) -> tuple[str, ...]:
    """The values an annotation gives for ``keys``, in their order; ``()`` (no place) when
    the value is missing or malformed or lacks one of the keys, so a stale or hand-edited
    annotation degrades to the flat model instead of failing."""
    labels = parse_labels(value) if value else None
    return place_values(labels, keys) if labels is not None else ()
