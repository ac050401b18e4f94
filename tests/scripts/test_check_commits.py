"""scripts/check_commits.py: the commit convention of CONTRIBUTING.md, on subjects and on a
real repository's log."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_commits",
                                                  ROOT / "scripts" / "check_commits.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_subjects() -> None:
    cc = _load()
    assert cc.problems("gateway: cap the request bytes held at once") == []
    assert cc.problems("sim/core, docs: two areas") == []
    assert cc.problems("x" * 60 + ": " + "y" * 11) == ["73 characters (at most 72)"]
    assert cc.problems("Fix the thing") == ["not `area: what changed`"]
    assert cc.problems("Gateway: capitalised area") == ["not `area: what changed`"]
    assert cc.problems("gateway:no space") == ["not `area: what changed`"]


def test_a_log_with_one_bad_subject_fails(tmp_path: Path) -> None:
    cc = _load()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                       env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                            "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "docs: a good one")
    git("commit", "-q", "--allow-empty", "-m", "a bad one")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cc.main(["HEAD~1..HEAD"]) == 1
        assert cc.main(["HEAD~1"]) == 0  # the first commit alone
    finally:
        os.chdir(cwd)
