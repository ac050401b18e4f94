"""Check commit subjects against CONTRIBUTING.md: at most 72 characters, ``area: what``.

    python scripts/check_commits.py [REV_RANGE]      # default: origin/main..HEAD

Exit 1 and list the offenders when any subject breaks the rule.
"""

from __future__ import annotations

import re
import subprocess
import sys

MAX_SUBJECT = 72
#: ``area: what changed`` with a lower-case area of letters, digits, ``-``, ``/`` or ``,``
SUBJECT = re.compile(r"^[a-z0-9][a-z0-9/,\- ]*: \S")


def problems(subject: str) -> list[str]:
    out = []
    if len(subject) > MAX_SUBJECT:
        out.append(f"{len(subject)} characters (at most {MAX_SUBJECT})")
    if not SUBJECT.match(subject):
        out.append("not `area: what changed`")
    return out


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else "origin/main..HEAD"
    log = subprocess.run(["git", "log", "--format=%h %s", rev], capture_output=True,
                         text=True, check=True).stdout
    bad = 0
    for line in log.splitlines():
        sha, _, subject = line.partition(" ")
        found = problems(subject)
        if found:
            bad += 1
            print(f"{sha} {subject}\n    {'; '.join(found)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
