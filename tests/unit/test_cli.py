"""The command contract: flags, clear usage errors, JSON on the last line."""

import json

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
