"""The envelope every published benchmark result shares, and how it is written.

A result document says how it was made: the command line that made it, when it
started, how long it ran and the host's load at its end (runs on a shared 2-core host
are read with that in mind), the settings, and the benchmark's own payload. The page
(Markdown) is printed and, like the document (JSON), written where asked.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def envelope(script: str, started: float, settings: Mapping[str, Any],
             **payload: Any) -> dict[str, Any]:
    """The result document of ``benchmarks/<script>``, run with this process's arguments
    since ``started`` (``time.time()``)."""
    return {"command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
            "started": started, "wall_s": time.time() - started,
            "load_end": os.getloadavg()[0], "settings": dict(settings), **payload}


def provenance(doc: Mapping[str, Any]) -> str:
    """The page's first sentence, from an :func:`envelope`: the command, how long it ran,
    when (UTC) and the host's load at its end."""
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(doc["started"]))
    return (f"`{doc['command']}` — {doc['wall_s'] / 60:.1f} min on {when} UTC, "
            f"load average {doc['load_end']:.1f} at the end.")


def publish(doc: Mapping[str, Any], page: str, json_out: Path | None,
            markdown: Path | None, indent: int = 1) -> None:
    """Print ``page``; write ``doc`` as JSON to ``json_out`` and ``page`` to ``markdown``
    when given."""
    print(page)
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=indent) + "\n")
    if markdown is not None:
        markdown.write_text(page)
