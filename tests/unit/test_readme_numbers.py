"""Claims come from files: every number the README (or docs/) quotes beside a results file
(`bench/results/NAME.md`, the demo's `docs/demo/summary.json`) is in that file, at the
precision the README writes it, so prose cannot drift from what the benchmarks measured; the
autoscaling headline is read from its report's table. A number that is not a measurement (a
status code, a workload's definition, a version) is listed below with why."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
NUMBER = re.compile(r"(?<![\w.'/])(\d[\d,]*(?:\.\d+)?)(k\b)?")
"""A number as prose writes it: thousands separators, decimals, `500k`; not part of a name
(`Qwen3`), a version (`0.5.23` is one number only after a letter or dot) or a year (`'24`)."""
CITED = re.compile(r"(?:bench/results/[\w-]+\.md|docs/demo/summary\.json)")

NOT_MEASURED = {
    "Sheng et al., OSDI'24": "a citation",
    "429 `adapter_loads_exceeded`": "an HTTP status",
    "(503 with `Retry-After`)": "an HTTP status",
    "sglang-router 0.3.2's": "a version",
    "at a round 50% of peak": "the priors' stated efficiency, an input",
    "calibration starting 2.5–3× too fast or too slow ends within\n25% of the true prefill rate"
    " and 15% of the true decode step": "tests/unit/test_calibration.py's bounds",
    "distinct 4,096-token system prompts": "the workload's definition",
    "(8k/128,": "the workload's definition",
    "its 300 s down window": "the spec's setting",
    "the 25-minute run": "the trace's length",
    "is 0.83 GPU-hours": "two GPUs × the trace's length, arithmetic",
    "at TP 1, 2 and 4 in 16-bit": "the profiled deployments' definition",
    "inference traces 2023": "the trace's name",
    "and 429s by reason": "an HTTP status",
}
"""README phrases holding a number that is not a measurement, with why."""


def _units(text: str) -> list[str]:
    """Paragraphs, list items and table rows: the text a results file's link vouches for."""
    units: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        starts = not line.strip() or line.startswith(("|", "- ", "#", "* "))
        if starts and current:
            units.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line)
    if current:
        units.append("\n".join(current))
    return units


def _value(token: re.Match[str]) -> Decimal:
    return Decimal(token[1].replace(",", "")) * (1000 if token[2] else 1)


def _values(text: str) -> list[Decimal]:
    return [_value(m) for m in NUMBER.finditer(text)]


def _in(token: re.Match[str], measured: list[Decimal]) -> bool:
    """The README's number is one of the file's, rounded (half up) as the README writes it."""
    step = Decimal(1).scaleb(-len(token[1].split(".")[1]) if "." in token[1] else 0)
    value = _value(token)
    return any(m.quantize(step, ROUND_HALF_UP) == value for m in measured)


def unmeasured(text: str) -> list[str]:
    """Each number of `text` that the results file its unit cites does not hold, in context."""
    for phrase in NOT_MEASURED:
        text = text.replace(phrase, "")
    found = []
    for unit in _units(text):
        names = sorted(set(CITED.findall(unit)))
        if not names:
            continue
        measured = _values("".join((ROOT / n).read_text() for n in names))
        for token in NUMBER.finditer(unit):
            if not _in(token, measured):
                context = unit[max(0, token.start() - 40) : token.end() + 10].replace("\n", " ")
                found.append(f"{', '.join(names)}: {token[0]!r} in …{context}…")
    return found


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_beside_a_results_file_is_in_it(path: Path) -> None:
    assert unmeasured(path.read_text()) == []


def test_the_check_sees_a_drifted_number() -> None:
    (row,) = [u for u in _units((ROOT / "README.md").read_text()) if "[pd](bench/results" in u]
    assert unmeasured(row) == []
    drifted = row.replace("20.7 req/s", "21.7 req/s")
    assert len(unmeasured(drifted)) == 1


def _rows(name: str) -> dict[tuple[str, str], dict[str, str]]:
    """A report's per-policy table: (trace, policy) → column → cell."""
    lines = (RESULTS / name).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| trace | policy |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["trace"], cells["policy"]] = cells
    return rows


def _percent(cell: str) -> Decimal:
    """A report's percentage rounded to the README's one decimal, half up as people round."""
    return Decimal(cell.split("%")[0]).quantize(Decimal("0.1"), ROUND_HALF_UP)


@pytest.mark.parametrize("trace", ["step", "flash"])
def test_the_autoscaling_headline_reads_the_report(trace: str) -> None:
    """The README's worst cases: kvfleet's mean, and KEDA's best attainment at any threshold
    with its GPU-hours (not the point the report picks at kvfleet's budget)."""
    rows = _rows("autoscale.md")
    readme = " ".join((ROOT / "README.md").read_text().split())
    kvfleet = _percent(rows[trace, "kvfleet"]["within SLO"])
    keda = max(
        (cells for (t, p), cells in rows.items() if t == trace and p.startswith("keda@")),
        key=lambda c: _percent(c["within SLO"]),
    )
    best = _percent(keda["within SLO"])
    gpu_hours = keda["GPU-hours"].split()[0]
    assert f"{kvfleet}%" in readme
    threshold = keda["policy"].removeprefix("keda@")
    claim = f"{best}% at {gpu_hours} GPU-hours ({trace}, threshold {threshold})"
    assert claim in readme
