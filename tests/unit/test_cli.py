"""The command contract: flags, clear usage errors, JSON on the last line."""

import json
from pathlib import Path

from click.testing import CliRunner

from kvfleet_cli.main import cli


def test_sim_offline_json_is_the_last_stdout_line() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "sim",
            "offline",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "h100",
            "--input-len",
            "256",
            "--output-len",
            "32",
            "--num-prompts",
            "16",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    for key in (
        "output_throughput",
        "input_throughput",
        "total_throughput",
        "request_throughput",
        "duration_s",
    ):
        assert data[key] > 0
    assert data["output_tokens"] == 16 * 32


def test_bad_flags_get_clear_errors() -> None:
    runner = CliRunner()
    r = runner.invoke(cli, ["sim", "offline", "--model", "gpt-9", "--gpu", "h100"])
    assert r.exit_code == 2 and "unknown model 'gpt-9'" in r.output
    r = runner.invoke(cli, ["sim", "offline", "--model", "llama-3.1-70b", "--gpu", "h100"])
    assert r.exit_code == 2 and "raise --tp-size" in r.output
    r = runner.invoke(
        cli, ["sim", "offline", "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "3"]
    )
    assert r.exit_code == 2 and "tp_size must be one of" in r.output
    r = runner.invoke(
        cli, ["sim", "serve", "--model", "llama-3.1-8b", "--gpu", "h100", "--stream-interval", "0"]
    )
    assert r.exit_code == 2 and "--stream-interval" in r.output


def test_reference_docs_are_generated_from_the_models() -> None:
    root = Path(__file__).resolve().parents[2]
    result = CliRunner().invoke(cli, ["docs", "--check", "--out", str(root / "docs")])
    assert result.exit_code == 0, f"{result.output} (run `make docs`)"
    text = (root / "docs" / "gateway-config.md").read_text()
    assert "| `limits.defaults.tokenBudget.period` | duration" in text


def test_stand_in_commands_load_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from kvfleet_cli.main import cli; "
        "from click.testing import CliRunner; CliRunner().invoke(cli, ['gateway', '--help']); "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('kvfleet_')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['kvfleet_cli', 'kvfleet_gateway']"


def test_usage_aggregates_gateways_per_tenant() -> None:
    from kvfleet_cli.usage_cmds import aggregate, usage_table

    samples = [  # two gateways' counters, and each one's view of the shared budget
        ("kvfleet_gateway_requests_total", {"tenant": "a", "status": "200"}, 3.0),
        ("kvfleet_gateway_requests_total", {"tenant": "a", "status": "200"}, 2.0),
        ("kvfleet_gateway_requests_total", {"tenant": "a", "status": "429"}, 1.0),
        ("kvfleet_gateway_tokens_total", {"tenant": "a", "kind": "prompt"}, 100.0),
        ("kvfleet_gateway_tokens_total", {"tenant": "a", "kind": "completion"}, 400.0),
        ("kvfleet_gateway_cost_total", {"tenant": "a", "model": "m"}, 0.02),
        ("kvfleet_gateway_budget_remaining_tokens", {"tenant": "a"}, 900.0),
        ("kvfleet_gateway_budget_remaining_tokens", {"tenant": "a"}, 800.0),
        ("kvfleet_gateway_budget_reserved_tokens", {"tenant": "a"}, 96.0),
        ("kvfleet_gateway_budget_reserved_tokens", {"tenant": "a"}, 0.0),
        ("kvfleet_gateway_requests_total", {"tenant": "b", "status": "200"}, 1.0),
        ("process_cpu_seconds_total", {}, 5.0),
    ]
    usage = aggregate(samples)
    a = usage["a"]
    assert (a.total_requests, a.requests["429"], a.billed_tokens, a.budget_left) == (6, 1, 500, 800)
    assert set(aggregate(samples, tenant="b")) == {"b"}
    lines = usage_table(usage).splitlines()
    assert lines[0].split() == ["TENANT", "REQUESTS", "OK", "429", "PROMPT", "COMPLETION",
                                "CACHED", "BUDGET-LEFT", "RESERVED", "COST",
                                "COST/1K"]  # fmt: skip
    assert lines[1].split() == ["a", "6", "5", "1", "100", "400", "0", "800", "0", "0.0200",
                                "0.0400"]  # fmt: skip
