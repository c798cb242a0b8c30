"""inference-perf's config as a fleet workload: its data and load sections, aliases and
distributions as inference-perf reads them, errors naming the field, and the routing bench
reporting one cell per stage."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvfleet_sim.fleet.workload_file import (
    WorkloadFileError,
    load_workload_file,
    parse_workload_file,
)

SAMPLE = Path(__file__).resolve().parents[2] / "bench" / "kvfleet_bench" / "data"

MODELS = Path(__file__).parents[1] / "data" / "models"


def test_the_sample_file_reads_as_inference_perf_reads_it() -> None:
    wf = load_workload_file(SAMPLE / "inference-perf-shared-prefix.yaml")
    assert wf.spec.kind == "generated-shared-prefix"
    assert (wf.spec.gsp_num_groups, wf.spec.gsp_prompts_per_group) == (256, 16)
    assert (wf.spec.gsp_system_prompt_len, wf.spec.gsp_question_len) == (2048, 128)
    assert [(s.rate, s.duration_s, s.start_s) for s in wf.arrivals.stages] == [
        (20, 30, 0), (60, 30, 35), (100, 30, 70)
    ]  # fmt: skip
    assert wf.spec.num_requests == 600 + 1800 + 3000
    times = wf.arrivals.arrivals(wf.spec.num_requests, random.Random(1))
    assert len(times) == 5400 and times == sorted(times)
    second = [t for t in times if 35 <= t <= 65]
    assert len(second) == 1800  # a stage's requests arrive within the stage


def test_aliases_distributions_and_constant_spacing() -> None:
    doc = {
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_unique_system_prompts": 4,
                "num_users_per_system_prompt": 3,
                "system_prompt_len": {"mean": 300, "std_dev": 10, "min": 1, "max": 500},
                "question_len": 20,
                "output_len": {"mean": 40},
            },
        },
        "load": {"type": "constant", "stages": [{"rate": 4, "duration": 2}]},
    }
    wf = parse_workload_file(json.dumps(doc), "w.yaml")
    assert (wf.spec.gsp_num_groups, wf.spec.gsp_prompts_per_group) == (4, 3)
    assert (wf.spec.gsp_system_prompt_len, wf.spec.gsp_output_len) == (300, 40)
    assert wf.arrivals.arrivals(8, random.Random(1)) == [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75]
    random_data = parse_workload_file(
        "data: {type: random, input_distribution: {mean: 700}, output_distribution: {mean: 90}}"
        "\nload: {stages: [{rate: 1, duration: 1}]}",
        "r.yaml",
    )
    assert (random_data.spec.kind, random_data.spec.input_len) == ("random", 700)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("data: {type: shared_prefix}\nload: {type: concurrent, stages: []}", "load.type"),
        ("data: {type: shared_prefix}\nload: {stages: [{rate: 0, duration: 5}]}", "stages[0].rate"),
        ("data: {type: shared_prefix}\nload: {stages: [{rate: 1}]}", "rate and duration"),
        ("data: {type: otel_trace_replay}\nload: {stages: [{rate: 1, duration: 1}]}", "data.type"),
        ("data: {type: shared_prefix}\nload: {sweep: {type: linear}}", "sweep"),
        ("data: [unclosed", "invalid YAML at line"),
    ],
)
def test_what_cannot_be_replayed_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(WorkloadFileError, match=r"w\.yaml") as err:
        parse_workload_file(text, "w.yaml")
    assert says in str(err.value)


def test_the_routing_bench_reports_each_stage(tmp_path: Path) -> None:
    from kvfleet_bench.routing import run_routing_bench

    file = tmp_path / "w.yaml"
    file.write_text(
        "data: {type: shared_prefix, shared_prefix: {num_groups: 8, num_prompts_per_group: 8,"
        " system_prompt_len: 512, question_len: 32, output_len: 32}}\n"
        "load: {type: poisson, stages: [{rate: 5, duration: 4}, {rate: 20, duration: 4}]}\n"
    )
    result = run_routing_bench(
        tmp_path, lambda _: None, replicas=2, policies=["round_robin", "kvfleet"],
        live=False, workload_file=file, event_pages=5_000,
    )  # fmt: skip
    cells = result["cells"]
    assert {(c["workload"], c["load"], c["policy"]) for c in cells} == {
        ("w", 5.0, "round_robin"), ("w", 20.0, "round_robin"),
        ("w", 5.0, "kvfleet"), ("w", 20.0, "kvfleet"),
    }  # fmt: skip
    assert all(c["ttft_p50"] <= c["ttft_p90"] <= c["ttft_p99"] for c in cells)
    text = (tmp_path / "routing.md").read_text()
    assert "## w (workload file)" in text and "| 20 req/s | **kvfleet** |" in text


def test_the_routing_bench_names_the_model_and_tp_it_simulates(tmp_path: Path) -> None:
    """With --model-config every line and the report name that model and its TP (they said
    the --model default, llama-3.1-8b), here on the long-prefix workload that once crashed
    the fleet: ~6,000-token shared prompts, ~1,200-token questions."""
    from kvfleet_bench.routing import run_routing_bench

    file = tmp_path / "long.yaml"
    file.write_text(
        "data: {type: shared_prefix, shared_prefix: {num_groups: 2, num_prompts_per_group: 8,"
        " system_prompt_len: 6000, question_len: 1200, output_len: 64}}\n"
        "load: {type: constant, stages: [{rate: 5, duration: 2}, {rate: 30, duration: 2}]}\n"
    )
    lines: list[str] = []
    run_routing_bench(
        tmp_path, lines.append, replicas=2, policies=["kvfleet"], live=False, workload_file=file,
        model_config=MODELS / "qwen3-32b", tp=2, event_pages=5_000,
    )  # fmt: skip
    assert any("on 2× qwen3-32b/h100 TP2" in line for line in lines), lines
    assert "2 replicas of qwen3-32b/h100 TP2" in (tmp_path / "routing.md").read_text()
    assert not any("llama" in line for line in lines), lines


def test_a_workload_the_engines_refuse_still_reports_every_stage(tmp_path: Path) -> None:
    """The routing bench on 30k–120k-token random prompts (mean 75k) against Llama-3.1-70B at
    TP2: every prompt is longer than a replica's KV pool, so SGLang refuses each (400). The
    bench counts the refusals in every cell and writes its report; it once died with
    InputTooLongError and printed nothing."""
    from kvfleet_bench.routing import run_routing_bench

    file = tmp_path / "long.yaml"
    file.write_text(
        "data: {type: random, input_distribution: {min: 30000, max: 120000, mean: 75000},"
        " output_distribution: {mean: 128}}\n"
        "load: {type: poisson, stages: [{rate: 2, duration: 5}]}\n"
    )
    lines: list[str] = []
    result = run_routing_bench(
        tmp_path, lines.append, model="llama-3.1-70b", tp=2, replicas=2,
        policies=["round_robin", "kvfleet"], live=False, workload_file=file, seeds=(1,),
        event_pages=5_000,
    )  # fmt: skip
    cells = result["cells"]
    assert {c["policy"] for c in cells} == {"round_robin", "kvfleet"}
    assert all(c["requests"] == 0 and c["refused"] > 0 for c in cells)
    assert any("refused" in line and "400: Input length (75000 tokens)" in line for line in lines)
    text = (tmp_path / "routing.md").read_text()
    assert "| refused |" in text
    assert "| 2 req/s | **kvfleet** | 0 [0–0] | — | — | — | 0.00 | 0.00 | 10 |" in text
