"""scripts/mutation.py without running mutmut: reading its results into per-module counts,
the kill rate, the gate, the config (the repository's own too), the staging's function
selection and progress parsing. One small end-to-end run at the end (a few seconds)."""

from __future__ import annotations

import fnmatch
import importlib.util
import io
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    path = ROOT / "scripts" / "mutation.py"
    spec = importlib.util.spec_from_file_location("mutation_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


mutation = _load()
Counts = mutation.Counts

RESULTS = """\
    mooncake_sim.metrics.x_percentile__mutmut_1: killed
    mooncake_sim.metrics.x_percentile__mutmut_2: survived
    mooncake_sim.metrics.x_latency_summary__mutmut_10: no tests
    mooncake_sim.metrics.x_latency_summary__mutmut_2: timeout
    mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_3: killed
    mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_4: segfault
    mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_5: suspicious
    mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_6: check was interrupted by user
    mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_7: not checked
a warning line mutmut printed: not a result
"""


# -- results --------------------------------------------------------------------------
def test_results_are_read_per_mutant() -> None:
    statuses = mutation.parse_results(RESULTS)
    assert len(statuses) == 9
    assert statuses["mooncake_sim.metrics.x_latency_summary__mutmut_10"] == "no tests"
    assert statuses["mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_6"] == (
        "check was interrupted by user")


def test_mutant_names_split_into_module_and_function() -> None:
    split = mutation.split_mutant_name
    assert split("mooncake_sim.metrics.x_percentile__mutmut_2") == (
        "mooncake_sim.metrics", "percentile")
    assert split("mooncake_worker.server.xǁWorkerǁ_handoff__mutmut_13") == (
        "mooncake_worker.server", "Worker._handoff")
    assert split("pkg.x_x_twice__mutmut_1") == ("pkg", "x_twice")
    names = ["m.x_f__mutmut_10", "m.x_f__mutmut_2", "m.x_e__mutmut_3"]
    assert sorted(names, key=mutation.mutant_sort_key) == [
        "m.x_e__mutmut_3", "m.x_f__mutmut_2", "m.x_f__mutmut_10"]


def test_counts_per_module() -> None:
    modules = mutation.count_by_module(mutation.parse_results(RESULTS))
    assert modules["mooncake_sim.metrics"] == Counts(killed=1, timeout=1, survived=1,
                                                     no_tests=1)
    # segfault counts as a timeout, suspicious as survived, interrupted/unchecked: not run
    assert modules["mooncake_worker.server"] == Counts(killed=1, timeout=1, survived=1,
                                                       not_run=2)
    both = mutation.total(modules.values())
    assert both.mutants == 9 and both.as_dict()["mutants"] == 9


def test_kill_rate_counts_timeouts_as_kills_and_untested_code_as_survivors() -> None:
    c = Counts(killed=6, timeout=2, survived=1, no_tests=1, not_run=5)
    assert c.kill_rate == pytest.approx(8 / 10)
    assert Counts(survived=3).kill_rate == 0.0
    assert Counts(no_tests=2, killed=2).kill_rate == 0.5
    assert Counts(not_run=4).kill_rate is None
    assert Counts().kill_rate is None


def test_an_unknown_status_counts_as_survived() -> None:
    c = Counts()
    c.add("a status from a newer mutmut")
    assert c == Counts(survived=1)


def test_counts_round_trip_through_the_json_report() -> None:
    c = Counts(killed=3, timeout=1, survived=2, no_tests=4, not_run=1)
    data = json.loads(json.dumps(c.as_dict()))
    assert data["kill_rate"] == pytest.approx(0.4)
    assert Counts.from_dict(data) == c


# -- gate -----------------------------------------------------------------------------
def _result(error: str | None = None, **counts: int) -> dict[str, Any]:
    return {"name": "t", "error": error, "counts": Counts(**counts).as_dict()}


def test_gate_passes_at_or_above_the_floor() -> None:
    assert mutation.gate_failure(_result(killed=8, survived=2), 0.8) is None
    assert mutation.gate_failure(_result(killed=9, timeout=1), 0.95) is None


def test_gate_fails_under_the_floor() -> None:
    reason = mutation.gate_failure(_result(killed=7, survived=2, no_tests=1), 0.75)
    assert reason is not None and "70.0%" in reason and "75.0%" in reason


def test_gate_fails_on_a_broken_or_incomplete_run() -> None:
    assert "failed" in mutation.gate_failure(_result(error="mutmut run exited 1", killed=10),
                                             0.0)
    assert "not run" in mutation.gate_failure(_result(killed=10, not_run=1), 0.0)
    assert mutation.gate_failure(_result(), 0.0) == "no mutants"


def test_gate_results_only_for_targets_with_a_floor() -> None:
    cfg = mutation.parse_config({"targets": {
        "a": {"mutate": ["p/a.py"], "tests": ["tests/a.py"], "gate": True, "floor": 0.5},
        "b": {"mutate": ["p/b.py"], "tests": ["tests/b.py"]},
    }})
    results = [{**_result(killed=1, survived=3), "name": "a"},
               {**_result(killed=0, survived=3), "name": "b"}]
    gate = mutation.gate_results(results, cfg)
    assert list(gate) == ["a"]
    assert gate["a"]["passed"] is False and gate["a"]["kill_rate"] == 0.25


# -- config ---------------------------------------------------------------------------
def test_config_rejects_typos_and_gates_without_a_floor() -> None:
    base = {"mutate": ["p/a.py"], "tests": ["tests/a.py"]}
    with pytest.raises(mutation.ConfigError, match="unknown keys"):
        mutation.parse_config({"targets": {"a": {**base, "test": ["x"]}}})
    with pytest.raises(mutation.ConfigError, match="needs a floor"):
        mutation.parse_config({"targets": {"a": {**base, "gate": True}}})
    with pytest.raises(mutation.ConfigError, match="between 0 and 1"):
        mutation.parse_config({"targets": {"a": {**base, "floor": 80}}})
    with pytest.raises(mutation.ConfigError, match="'tests' is required"):
        mutation.parse_config({"targets": {"a": {"mutate": ["p/a.py"]}}})
    for bad in (0, -5, "30", True):
        with pytest.raises(mutation.ConfigError, match="test_timeout_s"):
            mutation.parse_config({"targets": {"a": {**base, "test_timeout_s": bad}}})
    ok = mutation.parse_config({"targets": {"a": {**base, "test_timeout_s": 2.5}}})
    assert ok.targets["a"].test_timeout_s == 2.5


def test_config_reads_a_target_s_markers_and_process_isolation() -> None:
    base = {"mutate": ["p/a.py"], "tests": ["tests/a.py"]}
    cfg = mutation.parse_config({"targets": {
        "plain": base,
        "store": {**base, "markers": "not cluster", "process_isolation": "forkserver"}}})
    plain, store = cfg.targets["plain"], cfg.targets["store"]
    assert (plain.markers, plain.process_isolation) == (None, "fork")
    assert (store.markers, store.process_isolation) == ("not cluster", "forkserver")
    with pytest.raises(mutation.ConfigError, match="markers must be"):
        mutation.parse_config({"targets": {"a": {**base, "markers": ["store"]}}})
    with pytest.raises(mutation.ConfigError, match="process_isolation must be"):
        mutation.parse_config({"targets": {"a": {**base, "process_isolation": "spawn"}}})


def test_a_target_s_markers_replace_the_default_expression() -> None:
    default = ["-p", "no:cacheprovider", "-m", "not store and not cluster", "-q"]
    assert mutation.with_markers(default, None) == default
    assert mutation.with_markers(default, "not cluster") == [
        "-p", "no:cacheprovider", "-m", "not cluster", "-q"]
    assert mutation.with_markers(["-q"], "store") == ["-q", "-m", "store"]
    assert default[3] == "not store and not cluster"  # the settings are left as they were


def test_staging_hands_markers_and_isolation_to_mutmut(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "src" / "mooncake_tiny").mkdir(parents=True)
    (repo / "src" / "mooncake_tiny" / "__init__.py").write_text("")
    (repo / "src" / "mooncake_tiny" / "calc.py").write_text("def f() -> int:\n    return 1\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_text("")
    (repo / "pyproject.toml").write_text("")
    cfg = mutation.parse_config({
        "settings": {"packages": ["src/mooncake_*"],
                     "pytest_args": ["-m", "not store and not cluster"]},
        "targets": {
            "plain": {"mutate": ["mooncake_tiny/calc.py"], "tests": ["tests/test_calc.py"]},
            "store": {"mutate": ["mooncake_tiny/calc.py"], "tests": ["tests/test_calc.py"],
                      "markers": "not cluster", "process_isolation": "forkserver",
                      "test_timeout_s": 30}}})
    generated = {}
    for name, target in cfg.targets.items():
        mutation.build_staging(repo, cfg, target, tmp_path / name)
        text = (tmp_path / name / "pyproject.toml").read_text()
        generated[name] = tomllib.loads(text)["tool"]["mutmut"]
    plain, store = generated["plain"], generated["store"]
    assert "-o" not in plain["pytest_add_cli_args"]
    assert store["pytest_add_cli_args"][-2:] == ["-o", "timeout=30"]
    assert plain["pytest_add_cli_args"][:2] == ["-m", "not store and not cluster"]
    assert plain["process_isolation"] == "fork"
    assert store["pytest_add_cli_args"][:2] == ["-m", "not cluster"]
    assert store["process_isolation"] == "forkserver"


def test_the_repository_config_names_real_files_and_tests() -> None:
    cfg = mutation.load_config(ROOT / "mutation.toml")
    gated = [t for t in cfg.targets.values() if t.gate]
    assert gated and all(t.floor is not None for t in gated)
    package_roots = {pkg.parent for pattern in cfg.settings.packages
                     for pkg in ROOT.glob(pattern)}
    sources = {p.relative_to(base).as_posix(): p for base in package_roots
               for p in base.glob("mooncake_*/**/*.py")}
    for t in cfg.targets.values():
        globs, keep = mutation.split_mutate(t.mutate)
        for g in globs:
            assert any(fnmatch.fnmatch(s, g) for s in sources), (t.name, g)
        for file, names in keep.items():
            mutation.restrict_to_functions(sources[file].read_text(), names)
        tests, _ = mutation.expand_tests(ROOT, t.tests)  # raises for a missing file
        assert tests, t.name


def test_test_selection_keeps_node_ids_and_skips_unmatched_globs(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    tests, unmatched = mutation.expand_tests(tmp_path, [
        "tests/test_a.py::test_one", "tests/test_*.py", "tests/test_none*.py",
        "tests/test_a.py"])
    assert tests == ["tests/test_a.py::test_one", "tests/test_a.py"]
    assert unmatched == ["tests/test_none*.py"]
    with pytest.raises(mutation.ConfigError, match="does not exist"):
        mutation.expand_tests(tmp_path, ["tests/test_b.py"])


def test_generated_toml_reads_back() -> None:
    values = {"a": ["x", 'quote " and \\ back', "ǁ"], "b": True, "c": 0.5, "d": 3}
    text = mutation.toml_table("tool.mutmut", values)
    assert tomllib.loads(text)["tool"]["mutmut"] == values


# -- function selection -----------------------------------------------------------------
SOURCE = '''\
import math


def kept(x: int) -> int:
    return x + 1


def dropped(
    x: dict[str, int] = {},  # noqa: B006
    f=lambda y: y + 1,
) -> dict[str, int]:
    return {"a": x["a"] * 2}


class Cls:
    def meth(self, y: int) -> int:  # a comment
        return y - 1

    async def other(self) -> int: return 2


class Whole:
    def one(self) -> int:
        return 1 + 1
'''


def test_functions_outside_the_selection_are_marked_no_mutate() -> None:
    out = mutation.restrict_to_functions(SOURCE, {"kept", "Cls.meth", "Whole"})
    marked = [line for line in out.splitlines() if "no mutate block" in line]
    assert marked == [
        ") -> dict[str, int]:  # pragma: no mutate block",
        "    async def other(self) -> int: return 2  # pragma: no mutate block",
    ]
    assert out.replace("  # pragma: no mutate block", "") == SOURCE
    with pytest.raises(mutation.ConfigError, match="missing"):
        mutation.restrict_to_functions(SOURCE, {"missing"})


def test_mutmut_mutates_only_the_selected_functions(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mutmut")
    from mutmut.configuration import reset_config
    from mutmut.mutation.file_mutation import mutate_file_contents

    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nsource_paths = ["."]\n')
    monkeypatch.chdir(tmp_path)
    reset_config()
    try:
        out = mutation.restrict_to_functions(SOURCE, {"kept", "Cls.meth"})
        names = mutate_file_contents("m.py", out).mutant_names
    finally:
        reset_config()
    functions = {mutation.split_mutant_name("m." + n)[1] for n in names}
    assert functions == {"kept", "Cls.meth"}


# -- progress -------------------------------------------------------------------------
def test_progress_lines_and_phases_are_recognised() -> None:
    line = "⠋ 12/40  🎉 9 🫥 1  ⏰ 0  🤔 1  🙁 2  🔇 0  🧙 0"
    assert mutation.parse_status(line) == mutation.Tick(12, 40, 9, 1, 0, 1, 2)
    assert mutation.parse_status("    done") is None
    assert mutation.parse_phase("⠙ Running stats") == "Running stats"
    assert mutation.parse_phase("something else") is None


def test_stream_segments_split_at_carriage_returns_even_mid_character() -> None:
    data = "a\r⠋ 1/2  🎉 1\r⠙ 2/2\nend".encode()
    cut = data.index("🎉".encode()) + 2  # inside the 4-byte emoji
    assert list(mutation.segments([data[:cut], data[cut:]])) == [
        "a", "⠋ 1/2  🎉 1", "⠙ 2/2", "end"]


def test_plain_progress_prints_phases_and_each_tenth() -> None:
    out = io.StringIO()
    p = mutation.Progress(out, tty=False)
    p.begin("t")
    p.phase("Running stats")
    p.phase("Running stats")
    for done in range(0, 101):
        p.tick(mutation.Tick(done, 100, done, 0, 0, 0, 0))
    lines = out.getvalue().splitlines()
    assert sum("running stats" in line for line in lines) == 1
    assert sum("killed" in line for line in lines) == 11  # 0 %, 10 %, ... 100 %


# -- report ---------------------------------------------------------------------------
def _report() -> dict[str, Any]:
    modules = {"pkg.mod": Counts(killed=3, survived=1, no_tests=2).as_dict()}
    return {
        "mutmut": "3.8.1", "commit": "abc1234", "generated": "now", "cpus": 2,
        "targets": [{
            "name": "t", "description": "a target", "mutate": ["pkg/mod.py"],
            "tests": ["tests/test_mod.py"], "deselect": [], "subprocess_coverage": False,
            "wall_s": 75.0, "max_children": 2, "error": None,
            "counts": Counts(killed=3, survived=1, no_tests=2).as_dict(), "modules": modules,
            "undetected": [
                {"name": "pkg.mod.x_f__mutmut_1", "module": "pkg.mod", "function": "f",
                 "status": "survived", "line": 7, "diff": "--- a\n+++ b\n-x = 1\n+x = 2\n"},
                {"name": "pkg.mod.x_g__mutmut_1", "module": "pkg.mod", "function": "g",
                 "status": "no tests", "diff": "--- a\n"},
                {"name": "pkg.mod.x_g__mutmut_2", "module": "pkg.mod", "function": "g",
                 "status": "no tests", "diff": "--- a\n"},
            ],
        }],
        "gate": {"t": {"floor": 0.6, "kill_rate": 0.5, "passed": False,
                       "reason": "kill rate 50.0% is under the floor 60.0%"}},
    }


def test_markdown_report_has_the_table_the_survivors_and_the_gate() -> None:
    md = mutation.markdown_report(_report())
    assert "| t | pkg.mod | 6 | 3 | 1 | 0 | 2 | 0 | 50.0% |  |" in md
    assert "| **t** | **(all)** | **6** |" in md and "**1:15** |" in md
    assert "`pkg.mod.x_f__mutmut_1` (survived, line 7)\n\n```diff\n-x = 1\n+x = 2\n```" in md
    assert "No test reaches: `g` (2)." in md
    assert "FAIL: kill rate 50.0% is under the floor 60.0%" in md


def test_diffs_are_shown_compact_and_located_in_the_file() -> None:
    diff = ("--- m.py\n+++ m.py\n@@ -1,6 +1,6 @@\n def f(x):\n     a = 1\n"
            "-    return x < a\n+    return x <= a\n \n     # end\n")
    assert mutation.compact_diff(diff) == "     a = 1\n-    return x < a\n+    return x <= a\n "
    source = "import m\n\n\ndef f(x):\n    a = 1\n    return x < a\n\n    # end\n"
    spans = mutation.function_spans(source + "\n\nclass C:\n    def g(self):\n        pass\n")
    assert spans == {"f": (4, 6), "C.g": (12, 13)}
    assert mutation.changed_line(source, spans["f"], diff) == 6
    assert mutation.changed_line(source, spans["f"], "+    added\n") is None


def test_text_table_aligns_columns() -> None:
    table = mutation.text_table(mutation.summary_rows(_report()["targets"]))
    lines = table.splitlines()
    assert lines[0].startswith("target  module")
    assert len({len(line) for line in lines}) == 1
    assert lines[-1].split()[-2:] == ["50.0%", "1:15"]


# -- end to end -----------------------------------------------------------------------
TINY = '''\
def clamp(x: int, lo: int, hi: int) -> int:
    if x < lo:
        return lo
    return min(x, hi)


def untested(x: int) -> int:
    return x * 2
'''

TINY_TEST = '''\
from mooncake_tiny.calc import clamp


def test_clamp() -> None:
    assert clamp(-5, 0, 10) == 0
    assert clamp(50, 0, 10) == 10
'''


def test_a_tiny_target_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real mutmut run over a two-function package (about 10 s)."""
    pytest.importorskip("mutmut")
    repo = tmp_path / "repo"
    (repo / "src" / "mooncake_tiny").mkdir(parents=True)
    (repo / "src" / "mooncake_tiny" / "__init__.py").write_text("")
    (repo / "src" / "mooncake_tiny" / "calc.py").write_text(TINY)
    (repo / "tests").mkdir()
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_calc.py").write_text(TINY_TEST)
    (repo / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = \"-ra\"\n")
    (repo / "mutation.toml").write_text(
        '[settings]\npackages = ["src/mooncake_*"]\npytest_args = ["-p", "no:cacheprovider"]\n'
        '[targets.tiny]\ndescription = "tiny"\nmutate = ["mooncake_tiny/calc.py"]\n'
        'tests = ["tests/test_calc.py"]\ngate = true\nfloor = 0.95\n')
    report = tmp_path / "report"
    rc = mutation.main(["--gate", "--root", str(repo), "--config", str(repo / "mutation.toml"),
                        "--report", str(report), "--work", str(tmp_path / "work"),
                        "--max-children", "1"])
    out = capsys.readouterr().out
    data = json.loads((report / "mutation-report.json").read_text())
    (t,) = data["targets"]
    assert t["error"] is None, t
    counts = t["counts"]
    # `untested` is reached by no test; `clamp`'s boundary mutant (x <= lo) survives
    assert counts["no_tests"] >= 1 and counts["survived"] >= 1 and counts["killed"] >= 1
    assert {u["function"] for u in t["undetected"]} == {"clamp", "untested"}
    assert all(u["diff"].startswith("---") for u in t["undetected"])
    assert rc == 1 and "gate tiny" in out and "FAIL" in out  # under the 95 % floor
    assert "tiny" in (report / "mutation-report.md").read_text()

    # --resume after a new test: the killed results stand, the undetected mutants are
    # tested again against the current tests (mutmut collects the new test's coverage)
    (repo / "tests" / "test_calc.py").write_text(
        TINY_TEST + "\n\ndef test_untested() -> None:\n"
        "    from mooncake_tiny.calc import untested\n    assert untested(3) == 6\n")
    rc = mutation.main(["--resume", "--root", str(repo), "--config", str(repo / "mutation.toml"),
                        "--report", str(report), "--work", str(tmp_path / "work"),
                        "--max-children", "1"])
    (again,) = json.loads((report / "mutation-report.json").read_text())["targets"]
    assert rc == 0 and again["error"] is None and again["resumed"] is True
    assert again["counts"]["no_tests"] == 0
    assert again["counts"]["killed"] > counts["killed"]
    assert again["counts"]["survived"] == counts["survived"]  # the equivalent boundary one
    assert {u["function"] for u in again["undetected"]} == {"clamp"}
    assert again["counts"]["killed"] + again["counts"]["survived"] == \
        sum(counts[k] for k in ("killed", "survived", "no_tests", "timeout"))
    assert "mutmut tests every mutant again" not in capsys.readouterr().out


def test_resuming_tells_when_mutmut_will_discard_the_results(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "src" / "mooncake_tiny").mkdir(parents=True)
    (repo / "src" / "mooncake_tiny" / "__init__.py").write_text("")
    (repo / "src" / "mooncake_tiny" / "calc.py").write_text(TINY)
    (repo / "tests").mkdir()
    for name in ("test_a.py", "test_b.py"):
        (repo / "tests" / name).write_text("")
    (repo / "pyproject.toml").write_text("")

    def staged(tests: list[str], resume: bool) -> Any:
        cfg = mutation.parse_config({"settings": {"packages": ["src/mooncake_*"]},
                                     "targets": {"t": {"mutate": ["mooncake_tiny/calc.py"],
                                                       "tests": tests}}})
        return mutation.build_staging(repo, cfg, cfg.targets["t"], tmp_path / "t", resume)
    assert not staged(["tests/test_a.py"], False).results_discarded
    assert not staged(["tests/test_a.py"], True).results_discarded
    assert staged(["tests/test_a.py", "tests/test_b.py"], True).results_discarded


def test_resuming_forgets_only_undetected_results(tmp_path: Path) -> None:
    meta = tmp_path / "mutants" / "pkg" / "mod.py.meta"
    meta.parent.mkdir(parents=True)
    codes = {"m__mutmut_1": 1, "m__mutmut_2": 0, "m__mutmut_3": 33, "m__mutmut_4": 36,
             "m__mutmut_5": None, "m__mutmut_6": 5, "m__mutmut_7": 2, "m__mutmut_8": -24}
    meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}))
    assert mutation.reset_for_retest(tmp_path / "mutants") == 4
    after = json.loads(meta.read_text())
    assert after["exit_code_by_key"] == {**codes, "m__mutmut_2": None, "m__mutmut_3": None,
                                         "m__mutmut_6": None, "m__mutmut_7": None}
    assert after["durations_by_key"] == {}
    # only the names asked for
    meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}))
    assert mutation.reset_for_retest(tmp_path / "mutants", ["m__mutmut_[23]"]) == 2
    after = json.loads(meta.read_text())
    assert after["exit_code_by_key"] == {**codes, "m__mutmut_2": None, "m__mutmut_3": None}
    assert mutation.main(["--retest", "x*"]) == 2  # only with --resume
