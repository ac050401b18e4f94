"""Which engine releases and combinations the builders make pods for, and what a spec
asking for another one gets: ``Degraded`` with the reason ``UnsupportedEngine`` and a
message naming the field (the pods themselves are checked against each release's own code
in ``tests/conformance``)."""

from __future__ import annotations

import typing

import pytest
from mooncake_gateway.handshake import HANDSHAKES
from mooncake_gateway.settings import HandshakeName
from mooncake_operator import builders, engines, reconcile
from mooncake_operator.engines import Handshake, UnsupportedEngine, image_version, release_of
from mooncake_operator.spec import MooncakeClusterSpec

from .manifests import SETTINGS, example, with_updates


@pytest.mark.parametrize(("image", "version"), [
    ("vllm/vllm-openai:v0.33.0", "0.33.0"),
    ("docker.io/vllm/vllm-openai:0.33.0", "0.33.0"),
    ("lmsysorg/sglang:v0.5.23-cu130", "0.5.23"),
    ("registry:5000/team/sglang:v0.6.0rc1", "0.6.0rc1"),
    ("ghcr.io/x/vllm:v0.9.2.post1@sha256:" + "a" * 64, "0.9.2.post1"),
    ("vllm/vllm-openai:latest", None),
    ("vllm/vllm-openai", None),
    ("registry:5000/vllm", None),  # a registry port is no tag
    ("vllm/vllm-openai@sha256:" + "b" * 64, None),
    ("vllm/vllm-openai:nightly-0.33.0", None),
])
def test_the_version_an_image_tag_names(image: str, version: str | None) -> None:
    assert image_version(image) == version


def _vllm(**updates: object) -> MooncakeClusterSpec:
    return with_updates(example("vllm")[1], **updates)


def test_the_examples_are_supported_releases() -> None:
    for kind in ("vllm", "sglang"):
        release = release_of(example(kind)[1])
        assert release in engines.RELEASES and release.kind.value == kind


@pytest.mark.parametrize(("updates", "field", "words"), [
    ({"engine__image": "vllm/vllm-openai:v0.32.1"}, "spec.engine.version",
     "vllm 0.32.1 is not a supported release (supported: 0.33.0)"),
    ({"engine__image": "my.registry/serving/llm:prod"}, "spec.engine",
     "set spec.engine.version"),
    ({"engine__image": "my.registry/llm:prod", "engine__version": "0.31.0"},
     "spec.engine.version", "0.31.0 is not a supported release"),
    ({"model__blockSize": 48}, "spec.model.blockSize", "not 48"),
])
def test_an_unsupported_release_or_combination_is_refused_with_a_reason(
        updates: dict[str, object], field: str, words: str) -> None:
    spec = _vllm(**updates)
    with pytest.raises(UnsupportedEngine) as err:
        release_of(spec)
    assert str(err.value).startswith(field + ":") and words in str(err.value)
    # the reconciler's verdict: Degraded, reason UnsupportedEngine, the same message
    body = {"metadata": {"name": "x", "namespace": "n", "uid": "u"},
            "spec": spec.model_dump(by_alias=True)}
    parsed, problem = reconcile.parse_spec(body)
    assert parsed is None and problem is not None
    assert (problem.reason, problem.message) == ("UnsupportedEngine", str(err.value))


def test_an_explicit_version_wins_over_the_image_tag() -> None:
    spec = _vllm(engine__image="my.registry/llm:prod", engine__version="0.33.0")
    assert release_of(spec).version == "0.33.0"
    body = {"metadata": {"name": "x", "namespace": "n", "uid": "u"},
            "spec": spec.model_dump(by_alias=True)}
    assert reconcile.parse_spec(body)[1] is None


def test_the_simulated_engine_needs_no_release() -> None:
    ref, spec = example("simulated")
    assert engines.handshake(spec) is Handshake.KV_TRANSFER_PARAMS
    assert engines.bootstrap_port(spec) is None
    assert builders.gateway_model(ref, spec)["handshake"] == "kv-transfer-params"


@pytest.mark.parametrize(("kind", "store", "expected"), [
    ("vllm", True, "store"), ("vllm", False, "kv-transfer-params"),
    ("sglang", True, "bootstrap"), ("sglang", False, "bootstrap")])
def test_the_gateway_is_told_the_handshake_of_the_release(kind: str, store: bool,
                                                          expected: str) -> None:
    ref, spec = example(kind)
    spec = with_updates(spec, store__enabled=store)
    doc = builders.gateway_model(ref, spec)
    assert doc["handshake"] == expected
    assert doc["bootstrap_port"] == release_of(spec).bootstrap_port


def test_operator_and_gateway_name_the_same_handshakes() -> None:
    names = {h.value for h in Handshake}
    assert names == set(HANDSHAKES) == set(typing.get_args(HandshakeName))


def test_a_store_config_change_rolls_the_pods_that_read_it() -> None:
    ref, spec = example("vllm")
    before = builders.revision(ref, spec, SETTINGS)
    moved = with_updates(spec, store__master__rpcPort=50061)
    assert builders.revision(ref, moved, SETTINGS) != before
    config = next(o for o in builders.children(ref, moved, SETTINGS)
                  if o["metadata"]["name"].endswith("-mooncake-config"))
    assert ":50061" in next(iter(config["data"].values()))


def test_the_crd_names_every_supported_release() -> None:
    from mooncake_operator.spec import EngineSpec

    text = EngineSpec.model_fields["version"].description or ""
    for r in engines.RELEASES:
        assert f"{r.kind.value} {r.version}" in text
    named = {tuple(m.split()) for m in text.split("Supported: ")[1].split(" (")[0].split(", ")}
    assert named == {(r.kind.value, r.version) for r in engines.RELEASES}


def test_the_docs_table_names_every_supported_release() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "real-cluster.md").read_text()
    table = page.split("## Supported engine releases")[1].split("\n\n")[2]
    rows = {tuple(c.strip().lower() for c in line.split("|")[1:3])
            for line in table.splitlines()[2:]}
    assert rows == {(r.kind.value, r.version) for r in engines.RELEASES}
