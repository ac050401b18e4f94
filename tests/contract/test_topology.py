"""The topology annotation: written by the operator, read by the gateway."""

from __future__ import annotations

import json

import pytest
from mooncake_contract.topology import (
    MAX_LEVELS,
    format_place,
    parse_labels,
    parse_place,
    place_of,
    place_values,
)

KEYS = ("nvidia.com/gpu.clique", "topology.kubernetes.io/zone")


def test_a_place_round_trips_in_the_readers_order() -> None:
    node = {"topology.kubernetes.io/zone": "us-east-1a", "nvidia.com/gpu.clique": "nvl-3",
            "kubernetes.io/hostname": "gpu-17"}
    value = format_place(place_of(node, KEYS))
    assert json.loads(value) == {"nvidia.com/gpu.clique": "nvl-3",
                                 "topology.kubernetes.io/zone": "us-east-1a"}
    assert parse_place(value, KEYS) == ("nvl-3", "us-east-1a")
    assert parse_place(value, tuple(reversed(KEYS))) == ("us-east-1a", "nvl-3")
    # one text per place, whatever order the levels were listed in
    assert format_place(place_of(node, tuple(reversed(KEYS)))) == value


def test_a_label_the_node_lacks_is_empty_not_missing() -> None:
    value = format_place(place_of({"topology.kubernetes.io/zone": "b"}, KEYS))
    assert parse_place(value, KEYS) == ("", "b")


@pytest.mark.parametrize("value", [None, "", "not json", "[\"a\", \"b\"]", "{\"x\": 1}",
                                   json.dumps({KEYS[0]: "a"})])
def test_a_missing_stale_or_malformed_annotation_is_no_place(value: str | None) -> None:
    assert parse_place(value, KEYS) == ()


def test_no_levels_no_place() -> None:
    assert parse_place(format_place(place_of({}, KEYS)), ()) == ()
    assert place_values({"a": "1"}, ()) == ()


def test_labels_must_be_strings() -> None:
    assert parse_labels('{"a": "1", "b": 2}') is None
    assert parse_labels('{"a": "1"}') == {"a": "1"}


def test_at_most_max_levels() -> None:
    keys = [f"example.com/l{i}" for i in range(MAX_LEVELS + 1)]
    with pytest.raises(ValueError, match="at most"):
        format_place(place_of({}, keys))
