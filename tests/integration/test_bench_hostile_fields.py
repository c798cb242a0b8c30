"""`kvfleet bench hostile-fields` end to end: a gateway and a simulator as processes, every
vector of issue 55 fired, the report written where `--out` says, every vector held.

The one timing row (the largest spec's parse, goal 100 ms of CPU) is checked for its figure,
not its verdict: on a shared 2-core machine its median moved between 88 and 134 ms from run
to run, and `kvfleet bench spec` is where that figure is judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_hostile_field_vector_holds(tmp_path: Path) -> None:
    out = tmp_path / "hostile-fields.md"
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet_cli", "bench", "hostile-fields", "--out", str(out),
         "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    names = [v["name"] for v in result["vectors"]]
    assert len(names) == 16 and len(set(names)) == 16
    timing = result["vectors"][-1]
    assert timing["name"].startswith("largest spec") and timing["figure"].endswith(" ms")
    assert [v["name"] for v in result["vectors"][:-1] if not v["held"]] == [], result
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 16 and all(row.endswith("| yes |") for row in rows[:-1]), rows
