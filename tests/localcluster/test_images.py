"""Image entrypoints read from the repository's Dockerfiles (pure: a Dockerfile text in
the test, not the repository's own images)."""

from __future__ import annotations

from pathlib import Path

from mooncake_localcluster import images, podspec

DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM python:3.11-slim@sha256:0000 AS build
ENTRYPOINT ["pip"]
RUN pip wheel . \\
    --wheel-dir /wheels

FROM python:3.11-slim@sha256:0000
USER 65532:65532
# the CLI
entrypoint ["mooncake-operator"]
CMD ["--help"]
"""


def test_dockerfile_entrypoint_is_the_last_exec_form() -> None:
    assert images.dockerfile_entrypoint(DOCKERFILE) == ["mooncake-operator"]
    continued = 'FROM x\nENTRYPOINT ["tini", "--", \\\n  "mooncake-operator"]\n'
    assert images.dockerfile_entrypoint(continued) == ["tini", "--", "mooncake-operator"]
    assert images.dockerfile_entrypoint("FROM x\nENTRYPOINT exec app --flag\n") == [
        "/bin/sh", "-c", "exec app --flag"
    ]
    assert images.dockerfile_entrypoint("FROM x\nCMD [\"app\"]\n") is None
    backtick = "# escape=`\nFROM x\nENTRYPOINT [\"a\", `\n \"b\"]\n"
    assert images.dockerfile_entrypoint(backtick) == ["a", "b"]


def test_entrypoint_table_reads_images_and_settings_override(tmp_path: Path) -> None:
    for name, entry in (("operator", "mooncake-operator"), ("worker", "mooncake-operator")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "Dockerfile").write_text(DOCKERFILE.replace(
            '["mooncake-operator"]', f'["{entry}", "{name}"]'))
    (tmp_path / "notes").mkdir()  # no Dockerfile: no entry
    table = images.dockerfile_entrypoints(tmp_path)
    assert table == {
        "ghcr.io/mooncake-operator/operator": ["mooncake-operator", "operator"],
        "ghcr.io/mooncake-operator/worker": ["mooncake-operator", "worker"],
    }
    merged = images.entrypoint_table(tmp_path, {
        "mooncake-operator": ["mooncake-operator"],
        "ghcr.io/mooncake-operator/worker": ["my-worker"],
    })
    assert podspec.image_entrypoint("ghcr.io/mooncake-operator/worker:v1", merged) == ["my-worker"]
    assert podspec.image_entrypoint("ghcr.io/mooncake-operator/operator:v1", merged) == [
        "mooncake-operator", "operator"
    ]
    assert podspec.image_entrypoint("example.com/mooncake-operator:dev", merged) == [
        "mooncake-operator"
    ]
    assert images.dockerfile_entrypoints(tmp_path / "absent") == {}
    repo_images = images.find_images_dir()
    assert repo_images is None or repo_images.name == "images"


def test_the_pod_runner_uses_the_images_dir(tmp_path: Path) -> None:
    from mooncake_localcluster import cluster, podrunner
    from mooncake_localcluster.settings import LocalClusterSettings

    (tmp_path / "images" / "worker").mkdir(parents=True)
    (tmp_path / "images" / "worker" / "Dockerfile").write_text(DOCKERFILE)
    settings = LocalClusterSettings(state_dir=tmp_path / "state", images_dir=tmp_path / "images")
    runner = podrunner.PodRunner(settings, cluster.StatePaths(tmp_path / "state"), None)  # type: ignore[arg-type]
    assert runner.entrypoints == {
        "ghcr.io/mooncake-operator/worker": ["mooncake-operator"],
        "mooncake-operator": ["mooncake-operator"],
    }
