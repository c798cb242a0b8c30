"""The trace samples the benches replay: each real one is a verbatim cut of its source (the
cut command reproduces it), listed with its source and license; everything else is named as
synthetic, so no file's name claims a source it does not have."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfleet_bench.cli import bench
from kvfleet_bench.trace_cut import cut_trace
from kvfleet_sim.fleet.tracefile import read_trace

DATA = Path(__file__).resolve().parents[2] / "bench/kvfleet_bench/data"
REAL = {
    "azure-llm-2023-code-15min.csv": ("LICENSE-AzurePublicDataset-CC-BY-4.0", 900.0),
    "azure-llm-2023-conv-15min.csv": ("LICENSE-AzurePublicDataset-CC-BY-4.0", 900.0),
    "azure-llm-2023-conv-15min-at30m.csv": ("LICENSE-AzurePublicDataset-CC-BY-4.0", 900.0),
    "mooncake-fast25-conversation-10min.jsonl": ("LICENSE-Mooncake-Apache-2.0", 600.0),
}
START_S = {"azure-llm-2023-conv-15min-at30m.csv": 1800.0}
"""Where in its source a sample's window starts (0 unless named)."""


def test_every_trace_file_is_real_with_its_provenance_or_named_synthetic() -> None:
    readme = (DATA / "README.md").read_text()
    traces = [p.name for p in DATA.iterdir() if p.suffix in (".csv", ".jsonl")]
    assert set(REAL) <= set(traces)
    for name in traces:
        assert f"`{name}`" in readme, f"{name} is not described in data/README.md"
        if name not in REAL:
            assert name.startswith("synthetic-"), f"{name}: synthesized, named as real"
    for name, (license_file, window_s) in REAL.items():
        assert (DATA / license_file).read_text().strip(), license_file
        start = START_S.get(name, 0.0)
        assert f"{name} --start-s {start:.0f} --duration-s {window_s:.0f}" in readme
        rows = read_trace(DATA / name)
        assert rows[-1].time < window_s and len(rows) > 1000


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_cut_is_verbatim_and_reproducible(tmp_path: Path, name: str) -> None:
    """A cut of the carried sample over its own window gives the same bytes; a narrower one
    keeps exactly the lines whose arrival falls in it (header kept), unchanged."""
    source = DATA / name
    again = tmp_path / f"again{source.suffix}"
    result = CliRunner().invoke(
        bench, ["cut-trace", str(source), str(again), "--duration-s", str(REAL[name][1])]
    )
    assert result.exit_code == 0, result.output
    assert again.read_bytes() == source.read_bytes()
    part = tmp_path / f"part{source.suffix}"
    n = cut_trace(source, part, 200.0, 120.0)
    times = [r.time for r in read_trace(source)]
    assert n == sum(1 for t in times if 200.0 <= t < 320.0) > 0
    kept = part.read_text().splitlines()
    assert set(kept) <= set(source.read_text().splitlines())
    if source.suffix == ".csv":
        assert kept[0] == "TIMESTAMP,ContextTokens,GeneratedTokens"
