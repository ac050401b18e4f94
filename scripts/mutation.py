#!/usr/bin/env python3
"""Mutation testing with mutmut: per-target runs, a per-module report and a CI gate.

    python scripts/mutation.py [TARGET ...] [--report DIR] [--gate] [--merge] [--resume]

Targets live in ``mutation.toml`` (files to mutate, the fast tests that should kill the
mutants, the gate's floor). For each target this builds a staging directory with the
packages flat at its root (mutmut derives module names from paths and only puts
``mutants/`` on ``sys.path``), runs ``mutmut run`` there, and collects each mutant's
status and every undetected mutant's diff into ``DIR/mutation-report.{md,json}``.

Kill rate = (killed + timeout) / (killed + timeout + survived + no tests): a mutant the
tests time out on (or crash on) counts as detected; one no selected test reaches counts as
undetected. ``--gate`` runs the targets with ``gate = true`` (or the named ones) and exits
1 when a target's kill rate is under its ``floor``. See docs/mutation-testing.md.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import datetime as dt
import fnmatch
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "mutation_support"
MUTMUT_VERSION = "3.8.1"
REPORT_NAME = "mutation-report"
HITS_ENV = "MOONCAKE_MUTATION_HITS"
PLUGIN = "mooncake_mutation_plugin"

# mutmut's statuses (``mutmut results``), by how the report counts them
BUCKET_OF_STATUS = {
    "killed": "killed",
    "caught by type check": "killed",
    "timeout": "timeout",
    "segfault": "timeout",  # the test process died (SIGKILL after the CPU limit, a crash)
    "survived": "survived",
    "suspicious": "survived",
    "no tests": "no_tests",
    "skipped": "not_run",
    "not checked": "not_run",
    "check was interrupted by user": "not_run",
}
BUCKETS = ("killed", "timeout", "survived", "no_tests", "not_run")
UNDETECTED = ("survived", "no_tests")
TARGET_KEYS = {"description", "mutate", "tests", "deselect", "do_not_mutate",
               "subprocess_coverage", "markers", "process_isolation", "test_timeout_s", "gate",
               "floor"}
#: mutmut's ways to start a mutant's test process (its ``process_isolation`` setting)
PROCESS_ISOLATION = ("fork", "forkserver")
SETTINGS_KEYS = {"packages", "pytest_args", "do_not_mutate"}


class ConfigError(Exception):
    pass


# -- configuration ------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    name: str
    description: str
    mutate: tuple[str, ...]
    tests: tuple[str, ...]
    deselect: tuple[str, ...] = ()
    do_not_mutate: tuple[str, ...] = ()
    subprocess_coverage: bool = False
    markers: str | None = None
    process_isolation: str = "fork"
    #: pytest-timeout's limit per test in a mutant's run (a mutant that hangs a test fails
    #: it then); None: the project's own setting
    test_timeout_s: float | None = None
    gate: bool = False
    floor: float | None = None


@dataclass(frozen=True)
class Settings:
    packages: tuple[str, ...] = ("operator/mooncake_*", "worker/mooncake_*")
    pytest_args: tuple[str, ...] = ()
    do_not_mutate: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    settings: Settings
    targets: dict[str, Target]


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings")
    return tuple(value)


def parse_config(data: Mapping[str, Any]) -> Config:
    """The configuration of a parsed ``mutation.toml`` (unknown keys are errors)."""
    raw_settings = data.get("settings", {})
    unknown = set(raw_settings) - SETTINGS_KEYS
    if unknown:
        raise ConfigError(f"[settings]: unknown keys {sorted(unknown)}")
    settings = Settings(**{k: _strings(v, f"settings.{k}") for k, v in raw_settings.items()})
    targets: dict[str, Target] = {}
    for name, raw in data.get("targets", {}).items():
        where = f"[targets.{name}]"
        unknown = set(raw) - TARGET_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        for key in ("mutate", "tests"):
            if not raw.get(key):
                raise ConfigError(f"{where}: '{key}' is required")
        floor = raw.get("floor")
        if floor is not None and (not isinstance(floor, int | float) or not 0 <= floor <= 1):
            raise ConfigError(f"{where}: floor must be a kill rate between 0 and 1")
        if raw.get("gate") and floor is None:
            raise ConfigError(f"{where}: a gated target needs a floor")
        markers = raw.get("markers")
        if markers is not None and not isinstance(markers, str):
            raise ConfigError(f"{where}: markers must be a pytest -m expression (a string)")
        test_timeout = raw.get("test_timeout_s")
        if test_timeout is not None and (isinstance(test_timeout, bool)
                                         or not isinstance(test_timeout, int | float)
                                         or test_timeout <= 0):
            raise ConfigError(f"{where}: test_timeout_s must be a positive number of seconds")
        isolation = raw.get("process_isolation", "fork")
        if isolation not in PROCESS_ISOLATION:
            raise ConfigError(f"{where}: process_isolation must be one of {PROCESS_ISOLATION}")
        targets[name] = Target(
            name=name,
            description=str(raw.get("description", "")),
            mutate=_strings(raw["mutate"], f"{where} mutate"),
            tests=_strings(raw["tests"], f"{where} tests"),
            deselect=_strings(raw.get("deselect", []), f"{where} deselect"),
            do_not_mutate=_strings(raw.get("do_not_mutate", []), f"{where} do_not_mutate"),
            subprocess_coverage=bool(raw.get("subprocess_coverage", False)),
            markers=markers,
            process_isolation=isolation,
            test_timeout_s=None if test_timeout is None else float(test_timeout),
            gate=bool(raw.get("gate", False)),
            floor=None if floor is None else float(floor),
        )
    if not targets:
        raise ConfigError("no [targets.*] tables")
    return Config(settings, targets)


def load_config(path: Path) -> Config:
    with path.open("rb") as f:
        return parse_config(tomllib.load(f))


# -- results ------------------------------------------------------------------------------
@dataclass
class Counts:
    killed: int = 0
    timeout: int = 0
    survived: int = 0
    no_tests: int = 0
    not_run: int = 0

    @property
    def mutants(self) -> int:
        return self.killed + self.timeout + self.survived + self.no_tests + self.not_run

    @property
    def kill_rate(self) -> float | None:
        """Detected share of the mutants that ran or had no test; None without any."""
        detected = self.killed + self.timeout
        judged = detected + self.survived + self.no_tests
        return detected / judged if judged else None

    def add(self, status: str) -> None:
        # a status this version does not know is reported like mutmut's "suspicious"
        bucket = BUCKET_OF_STATUS.get(status, "survived")
        setattr(self, bucket, getattr(self, bucket) + 1)

    def __iadd__(self, other: Counts) -> Counts:
        for bucket in BUCKETS:
            setattr(self, bucket, getattr(self, bucket) + getattr(other, bucket))
        return self

    def as_dict(self) -> dict[str, Any]:
        return {"mutants": self.mutants, **{b: getattr(self, b) for b in BUCKETS},
                "kill_rate": self.kill_rate}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Counts:
        return cls(**{b: int(data[b]) for b in BUCKETS})


_RESULT_LINE = re.compile(r"^\s*(?P<name>\S+__mutmut_\d+): (?P<status>.+?)\s*$")


def parse_results(text: str) -> dict[str, str]:
    """Mutant name -> status, from the output of ``mutmut results --all true``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _RESULT_LINE.match(line)
        if m:
            out[m["name"]] = m["status"]
    return out


def split_mutant_name(name: str) -> tuple[str, str]:
    """``pkg.mod.xǁClsǁmeth__mutmut_3`` -> (``pkg.mod``, ``Cls.meth``); ``x_fn`` -> ``fn``."""
    module, _, mangled = name.rpartition(".")
    func = mangled.partition("__mutmut_")[0]
    if func.startswith("xǁ"):
        _, cls, meth = func.split("ǁ", 2)
        return module, f"{cls}.{meth}"
    return module, func.removeprefix("x_")


def mutant_sort_key(name: str) -> tuple[str, int]:
    """Orders ``f__mutmut_2`` before ``f__mutmut_10``."""
    stem, _, number = name.rpartition("__mutmut_")
    return stem, int(number) if number.isdigit() else -1


def count_by_module(statuses: Mapping[str, str]) -> dict[str, Counts]:
    out: dict[str, Counts] = {}
    for name, status in sorted(statuses.items()):
        out.setdefault(split_mutant_name(name)[0], Counts()).add(status)
    return out


def total(counts: Iterable[Counts]) -> Counts:
    out = Counts()
    for c in counts:
        out += c
    return out


def gate_failure(result: Mapping[str, Any], floor: float) -> str | None:
    """Why a gated target's result fails the gate, or None when it passes."""
    if result.get("error"):
        return f"the run failed: {result['error']}"
    counts = Counts.from_dict(result["counts"])
    if counts.not_run:
        return f"{counts.not_run} mutants were not run"
    rate = counts.kill_rate
    if rate is None:
        return "no mutants"
    if rate < floor:
        return f"kill rate {rate:.1%} is under the floor {floor:.1%}"
    return None


def compact_diff(diff: str, context: int = 1) -> str:
    """A unified diff's changed lines with ``context`` lines around them, without the file
    headers and hunk markers (mutmut's hunks count lines from the function's start)."""
    body = [line for line in diff.splitlines()
            if not line.startswith(("---", "+++", "@@"))]
    changed = [i for i, line in enumerate(body) if line[:1] in "+-" and line]
    keep = {j for i in changed for j in range(i - context, i + context + 1)}
    return "\n".join(line for i, line in enumerate(body) if i in keep)


def function_spans(source: str) -> dict[str, tuple[int, int]]:
    """First and last line of each top-level function and method (``Cls.meth``)."""
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    spans: dict[str, tuple[int, int]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, funcs):
            spans[node.name] = (node.lineno, node.end_lineno or node.lineno)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, funcs):
                    spans[f"{node.name}.{sub.name}"] = (sub.lineno, sub.end_lineno or sub.lineno)
    return spans


def changed_line(source: str, span: tuple[int, int], diff: str) -> int | None:
    """Line of ``source`` (within ``span``) that a mutant's diff changes first."""
    removed = [line[1:].strip() for line in diff.splitlines()
               if line.startswith("-") and not line.startswith("---")]
    if not removed:
        return None
    lines = source.splitlines()
    return next((i for i in range(span[0], min(span[1], len(lines)) + 1)
                 if lines[i - 1].strip() == removed[0]), None)


# -- staging ------------------------------------------------------------------------------
def split_mutate(entries: Sequence[str]) -> tuple[list[str], dict[str, set[str]]]:
    """File globs to mutate, and for ``FILE::NAME`` entries the names kept per file."""
    globs: list[str] = []
    keep: dict[str, set[str]] = {}
    for entry in entries:
        path, sep, name = entry.partition("::")
        if sep:
            if not name:
                raise ConfigError(f"{entry!r}: a function name must follow '::'")
            keep.setdefault(path, set()).add(name)
        if path not in globs:
            globs.append(path)
    return globs, keep


def _header_colon_line(tokens: Sequence[tokenize.TokenInfo], def_line: int) -> int:
    """Line of the colon ending the ``def`` header that starts on ``def_line``."""
    depth = 0
    started = False
    for tok in tokens:
        if tok.start[0] < def_line:
            continue
        if not started:
            started = tok.type == tokenize.NAME and tok.string == "def"
            continue
        if tok.type == tokenize.OP:
            if tok.string in "([{":
                depth += 1
            elif tok.string in ")]}":
                depth -= 1
            elif tok.string == ":" and depth == 0:
                return tok.start[0]
    raise ValueError(f"no header colon for the def on line {def_line}")


def restrict_to_functions(source: str, keep: set[str]) -> str:
    """``source`` with every top-level function and method not named in ``keep``
    (``fn``, ``Cls.meth`` or ``Cls`` for all its methods) marked ``# pragma: no mutate
    block``, so mutmut mutates only the kept ones. Raises ConfigError for a name that is
    not there."""
    import ast

    tree = ast.parse(source)
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    found: set[str] = set()
    skip: list[int] = []
    for node in tree.body:
        if isinstance(node, funcs):
            found.add(node.name)
            if node.name not in keep:
                skip.append(node.lineno)
        elif isinstance(node, ast.ClassDef):
            found.add(node.name)
            for sub in node.body:
                if isinstance(sub, funcs):
                    qual = f"{node.name}.{sub.name}"
                    found.add(qual)
                    if qual not in keep and node.name not in keep:
                        skip.append(sub.lineno)
    missing = keep - found
    if missing:
        raise ConfigError(f"no function {sorted(missing)} to mutate")
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines(keepends=True)
    for line_no in {_header_colon_line(tokens, n) for n in skip}:
        text = lines[line_no - 1]
        body = text.rstrip("\r\n")
        lines[line_no - 1] = body + "  # pragma: no mutate block" + text[len(body):]
    return "".join(lines)


def expand_tests(root: Path, entries: Sequence[str]) -> tuple[list[str], list[str]]:
    """Test selection (paths or node ids relative to ``root``) and the globs that matched
    nothing. A plain path that does not exist is an error."""
    out: list[str] = []
    unmatched: list[str] = []
    for entry in entries:
        path = entry.partition("::")[0]
        if glob.has_magic(entry) and "::" not in entry:
            matches = sorted(p.relative_to(root).as_posix() for p in root.glob(entry))
            if not matches:
                unmatched.append(entry)
            out.extend(m for m in matches if m not in out)
        elif not (root / path).exists():
            raise ConfigError(f"test selection {entry!r}: {path} does not exist")
        elif entry not in out:
            out.append(entry)
    return out, unmatched


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def toml_table(name: str, values: Mapping[str, Any]) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in values.items())


_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")


def with_markers(pytest_args: Sequence[str], markers: str | None) -> list[str]:
    """``pytest_args`` with the target's ``-m`` expression in place of the default one
    (added when the defaults have none); unchanged when the target names none."""
    args = list(pytest_args)
    if markers is None:
        return args
    for i, arg in enumerate(args[:-1]):
        if arg == "-m":
            args[i + 1] = markers
            return args
    return [*args, "-m", markers]


@dataclass
class Staging:
    path: Path
    tests: list[str]
    unmatched_tests: list[str]
    mutated_files: list[str]
    #: resuming, but mutmut will discard every earlier result (see ``build_staging``)
    results_discarded: bool = False


#: mutmut exit codes a resumed run tests again: survived, no tests, interrupted (``mutmut results``)
RETEST_EXIT_CODES = frozenset({0, 2, 5, 33})


def build_staging(root: Path, cfg: Config, target: Target, path: Path,
                  resume: bool = False, retest: Sequence[str] = ()) -> Staging:
    """A fresh mutmut project for ``target`` at ``path``; with ``resume`` and an earlier
    staging there, its ``mutants/`` (results, test timings) is kept and the sources and
    tests around it are replaced by the current ones."""
    kept = path / "mutants"
    resuming = resume and kept.is_dir()
    before: dict[str, Any] = {}
    if resuming and (path / "pyproject.toml").exists():
        with (path / "pyproject.toml").open("rb") as f:
            before = tomllib.load(f).get("tool", {}).get("mutmut", {})
    if resuming:
        for child in path.iterdir():
            if child != kept:
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    packages: list[str] = []
    for pattern in cfg.settings.packages:
        for src in sorted(root.glob(pattern)):
            if src.is_dir() and (src / "__init__.py").exists():
                shutil.copytree(src, path / src.name, ignore=_IGNORE)
                packages.append(src.name)
    if not packages:
        raise ConfigError(f"no packages match {list(cfg.settings.packages)} under {root}")
    shutil.copytree(root / "tests", path / "tests", ignore=_IGNORE)

    globs, keep = split_mutate(target.mutate)
    do_not = [*cfg.settings.do_not_mutate, *target.do_not_mutate]
    sources = sorted(p.relative_to(path).as_posix() for pkg in packages
                     for p in (path / pkg).rglob("*.py"))
    mutated = [s for s in sources if any(fnmatch.fnmatch(s, g) for g in globs)
               and not any(fnmatch.fnmatch(s, d) for d in do_not)]
    for g in globs:
        if not any(fnmatch.fnmatch(s, g) for s in sources):
            raise ConfigError(f"[targets.{target.name}] mutate {g!r} matches no file")
    for file, names in keep.items():
        src = path / file
        src.write_text(restrict_to_functions(src.read_text(encoding="utf-8"), names),
                       encoding="utf-8")

    tests, unmatched = expand_tests(root, target.tests)
    if not tests:
        raise ConfigError(f"[targets.{target.name}] selects no tests")
    pytest_args = [*with_markers(cfg.settings.pytest_args, target.markers), "-p", PLUGIN]
    if target.test_timeout_s is not None:
        pytest_args += ["-o", f"timeout={target.test_timeout_s:g}"]
    for node in target.deselect:
        pytest_args += ["--deselect", node]
    mutmut = {
        "source_paths": packages,
        "only_mutate": globs,
        "do_not_mutate": do_not,
        "pytest_add_cli_args": pytest_args,
        "pytest_add_cli_args_test_selection": tests,
        "use_git_change_detection": False,
        "process_isolation": target.process_isolation,
    }
    with (root / "pyproject.toml").open("rb") as f:
        pytest_ini = dict(tomllib.load(f).get("tool", {}).get("pytest", {})
                          .get("ini_options", {}))
    pytest_ini.pop("addopts", None)
    pytest_ini.update(testpaths=["tests"], pythonpath=["."])
    (path / "pyproject.toml").write_text(
        f"# generated by scripts/mutation.py for target {target.name}\n"
        + toml_table("tool.mutmut", mutmut) + "\n" + toml_table("tool.pytest.ini_options",
                                                                  pytest_ini),
        encoding="utf-8")
    # mutants/ must exist before Python starts with it on PYTHONPATH (a missing entry is
    # cached as absent, and `import tests` then fails)
    mutants = path / "mutants"
    mutants.mkdir(exist_ok=True)
    shutil.copy(SUPPORT / f"{PLUGIN}.py", mutants)
    discarded = False
    if resuming:
        reset_for_retest(mutants, retest)
        # mutmut drops every result when the pytest arguments or the test selection differ
        # from its last run's
        discarded = any(before.get(k) != mutmut[k] for k in
                        ("pytest_add_cli_args", "pytest_add_cli_args_test_selection"))
    if target.subprocess_coverage:
        shutil.copy(SUPPORT / "sitecustomize.py", mutants)
        (path / "hits").mkdir(exist_ok=True)
    return Staging(path, tests, unmatched, mutated, discarded)


def reset_for_retest(mutants: Path, patterns: Sequence[str] = ()) -> int:
    """Forget the result of every mutant that survived or that no test reached (of those
    whose names match one of ``patterns``, fnmatch-style, when given), so a resumed run
    tests it against the current tests; killed and timed-out mutants keep theirs. mutmut
    itself re-tests the mutants of any function whose source changed, and collects
    coverage for new tests. Returns how many results were forgotten."""
    forgotten = 0
    for meta in mutants.rglob("*.meta"):
        data = json.loads(meta.read_text(encoding="utf-8"))
        codes = data.get("exit_code_by_key", {})
        for name, code in codes.items():
            if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            if code in RETEST_EXIT_CODES:
                codes[name] = None
                forgotten += 1
        meta.write_text(json.dumps(data), encoding="utf-8")
    return forgotten


def mutmut_env(staging: Path, subprocess_coverage: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MUTANT_UNDER_TEST", HITS_ENV)}
    env["PYTHONPATH"] = str(staging / "mutants")
    env["PYTHONUNBUFFERED"] = "1"
    if subprocess_coverage:
        env[HITS_ENV] = str(staging / "hits")
    return env


# -- progress -----------------------------------------------------------------------------
_STATUS = re.compile(r"(\d+)/(\d+)\s+🎉 (\d+) 🫥 (\d+)\s+⏰ (\d+)\s+🤔 (\d+)\s+🙁 (\d+)")
_PHASES = ("Generating mutants", "Running stats", "Listing all tests", "Running clean tests",
           "Running forced fail test", "Running mutation testing")


@dataclass
class Tick:
    done: int
    total: int
    killed: int
    no_tests: int
    timeout: int
    suspicious: int
    survived: int


def parse_status(segment: str) -> Tick | None:
    """mutmut's progress line (``12/40  🎉 9 🫥 1  ⏰ 0  🤔 0  🙁 2 ...``), if it is one."""
    m = _STATUS.search(segment)
    return Tick(*(int(g) for g in m.groups())) if m else None


def parse_phase(segment: str) -> str | None:
    return next((p for p in _PHASES if p in segment), None)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


@dataclass
class Progress:
    """A bar redrawn in place on a terminal; plain lines (phases, every 10 %) in a log."""

    out: TextIO
    tty: bool
    target: str = ""
    started: float = field(default_factory=time.monotonic)
    _phase: str = ""
    _last_tenth: int = -1
    _last_line: float = 0.0

    def begin(self, target: str) -> None:
        self.target, self.started = target, time.monotonic()
        self._phase, self._last_tenth = "", -1

    def phase(self, name: str) -> None:
        if name == self._phase:
            return
        self._phase = name
        self._line(f"{name.lower()} ...", final=True)

    def tick(self, t: Tick) -> None:
        text = (f"{t.done}/{t.total}  killed {t.killed}  survived {t.survived + t.suspicious}"
                f"  no tests {t.no_tests}  timeout {t.timeout}")
        if self.tty:
            width = 24
            filled = width * t.done // t.total if t.total else 0
            self._line(f"[{'#' * filled}{'.' * (width - filled)}] {text}")
            return
        tenth = 10 * t.done // t.total if t.total else 0
        now = time.monotonic()
        if tenth != self._last_tenth or now - self._last_line > 120:
            self._last_tenth, self._last_line = tenth, now
            self._line(text, final=True)

    def _line(self, text: str, final: bool = False) -> None:
        line = f"{self.target:<20} {_clock(time.monotonic() - self.started):>7}  {text}"
        if self.tty:
            self.out.write("\r\x1b[K" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def end(self, text: str) -> None:
        if self.tty:
            self.out.write("\r\x1b[K")
        self._line(text, final=True)


def segments(chunks: Iterable[bytes]) -> Iterator[str]:
    """Text pieces of a byte stream split at ``\\r`` and ``\\n`` (the spinner redraws)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""
    for chunk in chunks:
        pending += decoder.decode(chunk)
        *done, pending = re.split(r"[\r\n]", pending)
        yield from (d for d in done if d.strip())
    pending += decoder.decode(b"", final=True)
    if pending.strip():
        yield pending


# -- running ------------------------------------------------------------------------------
def _read_chunks(fd: int, log: io.BufferedWriter) -> Iterator[bytes]:
    while chunk := os.read(fd, 65536):
        log.write(chunk)
        log.flush()
        yield chunk


def run_mutmut(staging: Staging, env: dict[str, str], max_children: int, log_path: Path,
               progress: Progress) -> int:
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=staging.path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.stdout is not None
        try:
            for seg in segments(_read_chunks(proc.stdout.fileno(), log)):
                tick = parse_status(seg)
                if tick is not None:
                    progress.tick(tick)
                elif (name := parse_phase(seg)) is not None:
                    progress.phase(name)
            return proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise


_DIFF_HELPER = """
import json, sys
from pathlib import Path
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
out = {}
for name, path in json.load(sys.stdin):
    try:
        where = path if Path(path).exists() else find_mutant(name).path
        out[name] = get_diff_for_mutant(name, path=where)
    except Exception as exc:
        out[name] = f"(no diff: {exc})"
json.dump(out, sys.stdout)
"""


def module_path(module: str, staging: Path) -> str:
    plain = module.replace(".", "/") + ".py"
    return plain if (staging / plain).exists() else module.replace(".", "/") + "/__init__.py"


def mutant_diffs(staging: Path, env: dict[str, str], names: Sequence[str]) -> dict[str, str]:
    if not names:
        return {}
    query = [(n, module_path(split_mutant_name(n)[0], staging)) for n in names]
    r = subprocess.run([sys.executable, "-c", _DIFF_HELPER], cwd=staging, env=env,
                       input=json.dumps(query), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return {n: f"(no diff: {r.stderr.strip()[-500:]})" for n in names}
    diffs: dict[str, str] = json.loads(r.stdout)
    return diffs


def run_target(root: Path, cfg: Config, target: Target, work: Path, logs: Path,
               max_children: int, progress: Progress, resume: bool = False,
               retest: Sequence[str] = ()) -> dict[str, Any]:
    progress.begin(target.name)
    started = time.monotonic()
    staging = build_staging(root, cfg, target, work / target.name, resume, retest)
    for g in staging.unmatched_tests:
        progress.end(f"note: no test file matches {g} (skipped)")
    if staging.results_discarded:
        progress.end("note: the test selection or pytest arguments changed since the run in "
                     f"{staging.path}; mutmut tests every mutant again")
    env = mutmut_env(staging.path, target.subprocess_coverage)
    log_path = logs / f"{target.name}.log"
    rc = run_mutmut(staging, env, max_children, log_path, progress)
    r = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                       cwd=staging.path, env=env, capture_output=True, text=True, check=False)
    statuses = parse_results(r.stdout)
    error = None
    if rc != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        error = f"mutmut run exited {rc} ({' / '.join(t.strip() for t in tail)[-300:]})"
    elif not statuses:
        error = f"no mutants in the results (exit {r.returncode}: {r.stderr.strip()[-300:]})"
    undetected = sorted((n for n, s in statuses.items()
                         if BUCKET_OF_STATUS.get(s, "survived") in UNDETECTED), key=mutant_sort_key)
    diffs = mutant_diffs(staging.path, env, undetected)
    sources: dict[str, tuple[str, dict[str, tuple[int, int]]]] = {}

    def line_of(name: str) -> int | None:
        module, function = split_mutant_name(name)
        if module not in sources:
            text = (staging.path / module_path(module, staging.path)).read_text(encoding="utf-8")
            sources[module] = (text, function_spans(text))
        text, spans = sources[module]
        span = spans.get(function)
        return changed_line(text, span, diffs.get(name, "")) if span else None

    modules = count_by_module(statuses)
    counts = total(modules.values())
    wall = time.monotonic() - started
    progress.end(f"done: {counts.mutants} mutants, kill rate {_pct(counts.kill_rate)}"
                 + (f"  ERROR {error}" if error else ""))
    return {
        "name": target.name,
        "description": target.description,
        "mutate": list(target.mutate),
        "tests": staging.tests,
        "deselect": list(target.deselect),
        "subprocess_coverage": target.subprocess_coverage,
        "markers": target.markers,
        "test_timeout_s": target.test_timeout_s,
        "process_isolation": target.process_isolation,
        "wall_s": round(wall, 1),
        "max_children": max_children,
        "resumed": resume,
        "error": error,
        "log": str(log_path),
        "counts": counts.as_dict(),
        "modules": {m: c.as_dict() for m, c in modules.items()},
        "undetected": [
            {"name": n, "module": split_mutant_name(n)[0],
             "function": split_mutant_name(n)[1], "status": statuses[n],
             "line": line_of(n), "diff": diffs.get(n, "")}
            for n in undetected
        ],
    }


# -- reporting ----------------------------------------------------------------------------
def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def summary_rows(targets: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Rows (target, module, counts, kill rate, wall time) of the summary table."""
    rows = []
    for t in targets:
        for module, c in t["modules"].items():
            rows.append([t["name"], module, *_count_cells(c), ""])
        wall = _clock(t["wall_s"])
        rows.append([t["name"], "(all)" if not t.get("error") else "(all) ERROR",
                     *_count_cells(t["counts"]), wall])
    return rows


def _count_cells(c: Mapping[str, Any]) -> list[str]:
    return [str(c["mutants"]), str(c["killed"]), str(c["survived"]), str(c["timeout"]),
            str(c["no_tests"]), str(c["not_run"]), _pct(c["kill_rate"])]


HEADER = ["target", "module", "mutants", "killed", "survived", "timeout", "no tests",
          "not run", "kill rate", "wall"]


def text_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in [HEADER, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_report(report: Mapping[str, Any]) -> str:
    out = [
        "# Mutation testing report",
        "",
        f"mutmut {report['mutmut']} at commit `{report['commit']}`, {report['generated']}, "
        f"on {report['cpus']} CPUs. Generated by `python scripts/mutation.py` "
        "(docs/mutation-testing.md).",
        "",
        "Kill rate = (killed + timeout) / (killed + timeout + survived + no tests). "
        "*survived*: the target's tests ran and still passed; *no tests*: none of the "
        "target's tests reaches the function; *timeout* includes test processes that "
        "crashed; *not run*: skipped or interrupted (excluded from the rate).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(HEADER) - 2)) + "|",
    ]
    targets = report["targets"]
    for row in summary_rows(targets):
        bold = row[1].startswith("(all)")
        cells = [f"**{c}**" if bold and c else c for c in row]
        out.append("| " + " | ".join(cells) + " |")
    gate = report.get("gate")
    if gate:
        out += ["", "## Gate", ""]
        for name, g in gate.items():
            verdict = "pass" if g["passed"] else f"FAIL: {g['reason']}"
            out.append(f"- `{name}`: floor {_pct(g['floor'])}, kill rate "
                       f"{_pct(g['kill_rate'])}: {verdict}")
    for t in targets:
        out += ["", f"## {t['name']}", "", t["description"], "",
                f"Mutated: {', '.join(f'`{m}`' for m in t['mutate'])}. "
                f"Tests: {', '.join(f'`{x}`' for x in t['tests'])}"
                + (f" (deselected: {', '.join(f'`{d}`' for d in t['deselect'])})"
                   if t["deselect"] else "")
                + ("; subprocess coverage on" if t["subprocess_coverage"] else "")
                + (f"; markers `{t['markers']}`" if t.get("markers") else "")
                + (f"; process isolation {t['process_isolation']}"
                   if t.get("process_isolation", "fork") != "fork" else "")
                + f". Wall time {_clock(t['wall_s'])} with {t['max_children']} workers."]
        if t.get("error"):
            out += ["", f"**Error:** {t['error']}"]
        by_module: dict[str, list[Mapping[str, Any]]] = {}
        for u in t["undetected"]:
            by_module.setdefault(u["module"], []).append(u)
        for module, items in by_module.items():
            out += ["", f"### {module}"]
            no_tests: dict[str, int] = {}
            for u in items:
                if u["status"] == "no tests":
                    no_tests[u["function"]] = no_tests.get(u["function"], 0) + 1
            if no_tests:
                out += ["", "No test reaches: " + ", ".join(
                    f"`{f}` ({n})" for f, n in sorted(no_tests.items())) + "."]
            for u in items:
                if u["status"] == "no tests":
                    continue
                where = f", line {u['line']}" if u.get("line") else ""
                out += ["", f"`{u['name']}` ({u['status']}{where})", "", "```diff",
                        compact_diff(u["diff"]), "```"]
    return "\n".join(out) + "\n"


def gate_results(targets: Sequence[Mapping[str, Any]], cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in targets:
        target = cfg.targets.get(t["name"])
        if target is None or target.floor is None:
            continue
        reason = gate_failure(t, target.floor)
        out[t["name"]] = {"floor": target.floor, "kill_rate": t["counts"]["kill_rate"],
                          "passed": reason is None, "reason": reason}
    return out


def _git_commit(root: Path) -> str:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                           check=False)
        return r.stdout.strip() if r.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def write_report(report_dir: Path, report: Mapping[str, Any]) -> tuple[Path, Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    js, md = report_dir / f"{REPORT_NAME}.json", report_dir / f"{REPORT_NAME}.md"
    js.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    md.write_text(markdown_report(report), encoding="utf-8")
    return js, md


# -- command line -------------------------------------------------------------------------
def _installed_mutmut() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mutmut")
    except PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("targets", nargs="*", metavar="TARGET",
                    help="targets of the config to run (default: all; with --gate: the gated)")
    ap.add_argument("--report", type=Path, default=ROOT / "mutation-report",
                    help="folder for mutation-report.{md,json} and logs/ (default: %(default)s)")
    ap.add_argument("--gate", action="store_true",
                    help="exit 1 when a run target's kill rate is under its floor")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other targets of an existing report in --report")
    ap.add_argument("--config", type=Path, default=ROOT / "mutation.toml")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository to test")
    ap.add_argument("--work", type=Path,
                    default=Path(tempfile.gettempdir()) / "mooncake-mutation",
                    help="staging folders, one per target (default: %(default)s)")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2,
                    help="mutants tested at once (default: %(default)s, the CPU count)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --work (stopped, or before new tests): keep the "
                         "killed and timed-out results, test the rest against the current tree")
    ap.add_argument("--retest", action="append", default=[], metavar="GLOB",
                    help="with --resume: test again only the undetected mutants whose names "
                         "match GLOB (repeatable; e.g. '*Gateway*_answer*')")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    args = ap.parse_args(argv)

    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"mutation: {args.config}: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for t in cfg.targets.values():
            flag = f" [gate, floor {t.floor:.0%}]" if t.gate and t.floor is not None else ""
            print(f"{t.name:<20} {t.description}{flag}")
        return 0
    unknown = [n for n in args.targets if n not in cfg.targets]
    if unknown:
        print(f"mutation: unknown targets {unknown}; known: {list(cfg.targets)}",
              file=sys.stderr)
        return 2
    if args.retest and not args.resume:
        print("mutation: --retest needs --resume", file=sys.stderr)
        return 2
    names = args.targets or [t.name for t in cfg.targets.values() if t.gate or not args.gate]
    installed = _installed_mutmut()
    if installed is None:
        print(f"mutation: mutmut is not installed (pip install mutmut=={MUTMUT_VERSION})",
              file=sys.stderr)
        return 2
    if installed != MUTMUT_VERSION:
        print(f"mutation: warning: mutmut {installed} installed, written for {MUTMUT_VERSION}",
              file=sys.stderr)

    root = args.root.resolve()
    logs = args.report / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    progress = Progress(sys.stdout, sys.stdout.isatty())
    commit = _git_commit(root)  # what the staging folders are built from (a run takes hours)
    results: list[dict[str, Any]] = []
    for name in names:
        try:
            results.append(run_target(root, cfg, cfg.targets[name], args.work.resolve(), logs,
                                      args.max_children, progress, args.resume,
                                      args.retest))
        except ConfigError as exc:
            print(f"mutation: {name}: {exc}", file=sys.stderr)
            return 2
    previous: list[dict[str, Any]] = []
    old = args.report / f"{REPORT_NAME}.json"
    if args.merge and old.exists():
        previous = [t for t in json.loads(old.read_text(encoding="utf-8"))["targets"]
                    if t["name"] not in names]
    order = list(cfg.targets)
    merged = sorted(previous + results,
                    key=lambda t: order.index(t["name"]) if t["name"] in order else len(order))
    report: dict[str, Any] = {
        "mutmut": installed,
        "commit": commit,
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "kill_rate": "(killed + timeout) / (killed + timeout + survived + no tests)",
        "targets": merged,
        "gate": gate_results(merged, cfg),
    }
    js, md = write_report(args.report, report)
    print()
    print(text_table(summary_rows(results)))
    print(f"\nreport: {md}\n        {js}")
    failed = [t["name"] for t in results if t.get("error")]
    if args.gate:
        for name, g in report["gate"].items():
            if name in names:
                verdict = "pass" if g["passed"] else f"FAIL ({g['reason']})"
                print(f"gate {name}: kill rate {_pct(g['kill_rate'])}, "
                      f"floor {_pct(g['floor'])}: {verdict}")
        if any(not g["passed"] for n, g in report["gate"].items() if n in names):
            return 1
    if failed:
        print(f"mutation: the run failed for {failed} (see the logs in {logs})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
