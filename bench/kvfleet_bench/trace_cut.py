"""Cut a window of a public production trace, verbatim: the lines of the full file whose
arrival falls in [start, start + duration) seconds after its first request, header kept.
`kvfleet bench cut-trace` runs it; `bench/kvfleet_bench/data/README.md` lists the command
that cut each sample the bench carries, so anyone with the full file gets the same bytes.

Two formats, as `kvfleet_sim.fleet.tracefile` reads them: the Azure LLM inference CSV
(`TIMESTAMP,ContextTokens,GeneratedTokens`) and Mooncake's JSON Lines (`timestamp` in ms).
Nothing is re-timed or rescaled here: the rate scaling is the bench's `--rate-scale`."""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet_sim.fleet.tracefile import TraceFileError, azure_timestamp


def _arrival(line: str, jsonl: bool) -> float:
    if jsonl:
        return float(json.loads(line)["timestamp"]) / 1000.0
    return azure_timestamp(line.split(",", 1)[0])


def cut_trace(source: Path, out: Path, start_s: float, duration_s: float) -> int:
    """Write the window of `source` to `out`; the number of requests written."""
    jsonl = source.suffix == ".jsonl"
    lines = source.read_text().splitlines(keepends=True)
    header, body = ([], lines) if jsonl else (lines[:1], lines[1:])
    body = [x for x in body if x.strip()]
    if not body:
        raise TraceFileError(f"{source}: no requests")
    try:
        times = [_arrival(x, jsonl) for x in body]
    except (ValueError, KeyError, IndexError) as exc:
        raise TraceFileError(f"{source}: {type(exc).__name__}: {exc}") from None
    first = min(times)
    kept = [x for x, t in zip(body, times, strict=True)
            if start_s <= t - first < start_s + duration_s]  # fmt: skip
    out.write_text("".join(header + kept))
    return len(kept)
