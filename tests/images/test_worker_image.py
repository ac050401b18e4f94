"""The worker image installs the project's wheel with ``--no-deps`` next to only
``images/worker/requirements.txt``. Proof that this is enough, without Docker:

- every import the worker's packages make, however deep or lazy, is the standard library,
  the project, or a distribution pinned in the worker's file (read from the source);
- in a fresh interpreter where every other installed distribution is unimportable (as in
  the image), the worker's and the store node's modules import, the CLI builds its parser
  and ``worker --help`` / ``store-node --help`` run; a subcommand of the operator says in
  one line that it belongs to the other image;
- the same with the operator's, the gateway's, the simulator's and the embedded cluster's
  packages themselves unimportable: the worker never needs them.

And the pins: exact, each the whole closure of its image, within ``pyproject.toml``'s
specifiers, one version per distribution across both images.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.utils import canonicalize_name

from tests.needs import missing

from .dockerfile import ROOT

#: what the worker image runs: its packages, whole
WORKER_PACKAGES = ("mooncake_worker", "mooncake_contract", "mooncake_conductor")
#: the CLI's own module (its parts are found by name, at run time)
WORKER_MODULES = ("mooncake_cli.main", "mooncake_cli.__main__")
PROJECT_PACKAGES = ("mooncake_cli", "mooncake_conductor", "mooncake_contract",
                    "mooncake_gateway", "mooncake_localcluster", "mooncake_operator",
                    "mooncake_sim", "mooncake_worker")
NOT_IN_WORKER = ("mooncake_gateway", "mooncake_localcluster", "mooncake_operator",
                 "mooncake_sim")
#: import name -> distribution when the distribution is not installed here
KNOWN = {"mooncake": "mooncake-transfer-engine-non-cuda"}


def _pins() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_pins", ROOT / "images" / "pins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pins = _pins()


def _worker_distributions() -> set[str]:
    return set(pins.read(pins.WORKER_FILE))


def _source_files() -> list[Path]:
    files: list[Path] = []
    for package in WORKER_PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations
        for location in spec.submodule_search_locations:
            files += sorted(Path(location).rglob("*.py"))
    for module in WORKER_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin
        files.append(Path(spec.origin))
    return files


def _imported_top_levels(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file, at any depth (lazy
    imports inside functions included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_import_of_the_worker_is_pinned_in_its_image() -> None:
    allowed = _worker_distributions()
    providers = metadata.packages_distributions()
    problems = []
    for path in _source_files():
        for name in sorted(_imported_top_levels(path)):
            if name in sys.stdlib_module_names or name in PROJECT_PACKAGES:
                continue
            dists = {canonicalize_name(d) for d in providers.get(name, [])}
            dists |= {canonicalize_name(KNOWN[name])} if name in KNOWN else set()
            if not dists & allowed:
                problems.append(f"{path.relative_to(ROOT)} imports {name} "
                                f"(from {sorted(dists) or 'no installed distribution'})")
    assert not problems, ("not in images/worker/requirements.txt (add it to "
                          "WORKER_DEPENDENCIES in images/pins.py):\n" + "\n".join(problems))


CHILD = r"""
import importlib, importlib.abc, json, pkgutil, sys

at_start = {m.split(".")[0] for m in sys.modules}  # site's .pth hooks: not the worker's
blocked = set(json.loads(sys.argv[1]))

class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInTheImage())
for package in json.loads(sys.argv[2]):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
if importlib.util.find_spec("mooncake") is not None:
    import mooncake.store  # the store node's client (the wheel's native module)

from mooncake_cli.main import build_parser, main
commands = sorted(build_parser()._subparsers._group_actions[0].choices)
for argv in (["worker", "--help"], ["store-node", "--help"]):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
rc = main(["operator", "crd"]) if "operator" in commands else None
print(json.dumps({"commands": commands, "operator_rc": rc,
                  "loaded": sorted({m.split(".")[0] for m in sys.modules} - at_start)}))
"""


def _blocked_third_party() -> set[str]:
    """Top-level import names that only distributions outside the worker's file give."""
    allowed = _worker_distributions() | {"mooncake-operator"}
    out = set()
    for name, dists in metadata.packages_distributions().items():
        if name in sys.stdlib_module_names or name in PROJECT_PACKAGES:
            continue
        if not {canonicalize_name(d) for d in dists} & allowed:
            out.add(name)
    return out


def _run_child(blocked: set[str]) -> tuple[dict[str, object], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "operator"), str(ROOT / "worker"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(sorted(blocked)),
         json.dumps(list(WORKER_PACKAGES))],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_worker_runs_with_only_its_pinned_distributions() -> None:
    blocked = _blocked_third_party()
    assert {"kopf", "kubernetes", "yaml", "orjson"} <= blocked  # the operator's, not ours
    out, stderr = _run_child(blocked)
    assert {"worker", "store-node"} <= set(out["commands"])  # type: ignore[arg-type]
    # `operator crd` needs PyYAML: one line that names the other image, exit status 1
    assert out["operator_rc"] == 1
    message = [ln for ln in stderr.splitlines() if "mooncake-operator operator:" in ln]
    assert message and "'yaml' is not installed" in message[0], stderr[-2000:]
    assert not set(out["loaded"]) & blocked  # type: ignore[arg-type]


def test_worker_never_needs_the_operator_or_the_gateway() -> None:
    out, _ = _run_child(_blocked_third_party() | set(NOT_IN_WORKER))
    commands = set(out["commands"])  # type: ignore[arg-type]
    assert {"worker", "store-node"} <= commands
    # the absent parts are left out of the CLI, not an import error
    assert not commands & {"operator", "gateway", "simulate", "local-cluster"}
    assert not set(out["loaded"]) & set(NOT_IN_WORKER)  # type: ignore[arg-type]


def test_pins_are_exact_and_each_a_closure() -> None:
    try:  # the closure is read from installed metadata: the store extra too
        metadata.distribution(KNOWN["mooncake"])
    except metadata.PackageNotFoundError:
        missing("store", "Mooncake's wheel is not installed: pip install -e '.[dev,store]'")
    operator_pins, worker_pins = pins.read(pins.OPERATOR_FILE), pins.read(pins.WORKER_FILE)
    assert pins.main(["--check"]) == 0, "run `python images/pins.py --write`"
    # pyproject's specifiers hold for what the images install
    for requirements, pinned in ((pins.operator_requirements(), operator_pins),
                                 (pins.worker_requirements(), worker_pins)):
        for req in requirements:
            version = pinned[canonicalize_name(req.name)]
            assert req.specifier.contains(version, prereleases=True), (req, version)
    # one version of a distribution in both images
    for name in set(operator_pins) & set(worker_pins):
        assert operator_pins[name] == worker_pins[name], name


def test_pins_reject_anything_but_exact_versions(tmp_path: Path) -> None:
    bad = tmp_path / "requirements.txt"
    bad.write_text("# ok\nnumpy==2.0\naiohttp>=3\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not an exact pin"):
        pins.read(bad)


def test_pin_check_excuses_only_what_other_versions_explain(capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    path = pins.OPERATOR_FILE
    requirers = {"kubernetes": set(), "python-dateutil": {"kubernetes"},
                 "six": {"python-dateutil"}}
    installed = {"kubernetes": "37.0.3", "python-dateutil": "2.9.0", "six": "1.17.0"}
    # every version as pinned: strict, both ways
    same = {"kubernetes": "37.0.3", "python-dateutil": "2.9.0", "tzdata": "2025.1"}
    assert pins._excuse(path, installed, same, requirers, ["tzdata"], ["six"]) == (
        ["tzdata"], ["six"])
    # python-dateutil pinned at 4.0: its six and tzdata are not judged, and named
    other = {**same, "python-dateutil": "4.0.0"}
    assert pins._excuse(path, installed, other, requirers, ["tzdata"], ["six"]) == ([], [])
    assert "python-dateutil" in capsys.readouterr().err
    # a missing distribution something verified requires stays missing
    requirers["six"].add("kubernetes")
    assert pins._excuse(path, installed, other, requirers, [], ["six"]) == ([], ["six"])
