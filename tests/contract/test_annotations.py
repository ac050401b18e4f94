"""The replica-annotation contract: Go quoting as the kubelet writes it, parsing, and the
writer's output read back (golden vectors pin both sides)."""

from __future__ import annotations

import json

import pytest
from mooncake_contract.annotations import (
    REPLICA_ANNOTATION,
    ReplicaSpec,
    format_replicas,
    go_quote,
    go_unquote,
    parse_annotations,
    parse_replicas,
)
from mooncake_contract.conventions import ANNOTATION_REPLICAS

# What the kubelet wrote for these values (Go's strconv.Quote); checked by hand against
# the Go rules: backslash and quote escaped, \n \t as letters, other C0 as \x.., Unicode
# printable kept.
GOLDEN_QUOTES = [
    ('[{"prefix":"a"}]', r'"[{\"prefix\":\"a\"}]"'),
    ("a\\b\n\tc", r'"a\\b\n\tc"'),
    ("\x01é€", '"\\x01é€"'),
]


@pytest.mark.parametrize(("raw", "quoted"), GOLDEN_QUOTES)
def test_go_quote_golden(raw: str, quoted: str) -> None:
    assert go_quote(raw) == quoted
    assert go_unquote(quoted) == raw


def test_go_unquote() -> None:
    assert go_unquote(r'"a\"b\\c\n\t\u00e9\x41\U0001F600"') == 'a"b\\c\n\té' + "A\U0001f600"
    assert go_unquote(r'"\xc3\xa9"') == "é"
    with pytest.raises(ValueError):
        go_unquote("unquoted")


def test_parse_annotations_and_replicas() -> None:
    value = json.dumps([{"prefix": "p1", "tokens": [1, 2, 3]}, {"prefix": 7, "keys": [9]}])
    text = f'a="1"\nbroken line\n{REPLICA_ANNOTATION}={go_quote(value)}\n'
    ann = parse_annotations(text)
    assert ann["a"] == "1"
    specs = parse_replicas(ann[REPLICA_ANNOTATION])
    assert [(s.prefix, s.tokens, s.keys) for s in specs] == [("p1", [1, 2, 3], None),
                                                             ("7", None, [9])]
    for bad in ('{"prefix": 1}', '[{"tokens": [1]}]', '[{"prefix": "x"}]',
                '[{"prefix": "x", "tokens": ["a"]}]', "not json"):
        with pytest.raises(ValueError):
            parse_replicas(bad)


def test_format_replicas_golden_and_round_trip() -> None:
    specs = [ReplicaSpec("00ff", tokens=[5, 6]), ReplicaSpec("k", keys=[2**64 - 1])]
    value = format_replicas(specs)
    assert value == ('[{"prefix":"00ff","tokens":[5,6]},'
                     '{"prefix":"k","keys":[18446744073709551615]}]')
    assert parse_replicas(value) == specs
    # through the downward-API file as the kubelet writes it
    text = f"{REPLICA_ANNOTATION}={go_quote(value)}\n"
    assert parse_replicas(parse_annotations(text)[REPLICA_ANNOTATION]) == specs


def test_annotation_name_is_the_convention() -> None:
    assert REPLICA_ANNOTATION == ANNOTATION_REPLICAS == "mooncake.io/replicas"
