"""The command contract: flags, clear usage errors, JSON on the last line."""

import json
from pathlib import Path
from typing import Any

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
    assert out.stdout.strip() == "['kvfleet_cli', 'kvfleet_gateway', 'kvfleet_kernel']"


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


def test_usage_by_tenant_and_model_at_each_models_price() -> None:
    """A shared gateway's usage: one row per tenant and model, the tenant's cost budget (which
    spans its models) on each."""
    from kvfleet_cli.usage_cmds import aggregate, usage_table

    samples = [
        (
            "kvfleet_gateway_requests_total",
            {"tenant": "bot", "model": "small", "status": "200"},
            4.0,
        ),
        (
            "kvfleet_gateway_requests_total",
            {"tenant": "bot", "model": "large", "status": "200"},
            1.0,
        ),
        (
            "kvfleet_gateway_tokens_total",
            {"tenant": "bot", "model": "small", "kind": "completion"},
            1000.0,
        ),
        (
            "kvfleet_gateway_tokens_total",
            {"tenant": "bot", "model": "large", "kind": "completion"},
            250.0,
        ),
        ("kvfleet_gateway_cost_total", {"tenant": "bot", "model": "small"}, 0.0004),
        ("kvfleet_gateway_cost_total", {"tenant": "bot", "model": "large"}, 0.0009),
        ("kvfleet_gateway_budget_remaining_cost", {"tenant": "bot"}, 4.9987),
    ]
    usage = aggregate(samples, by_model=True)
    assert set(usage) == {"bot × small", "bot × large"}
    assert usage["bot × large"].cost == 0.0009 and usage["bot × small"].total_requests == 4
    lines = usage_table(usage).splitlines()
    assert "4.9987 (cost)" in lines[1] and "4.9987 (cost)" in lines[2]
    assert aggregate(samples)["bot"].cost == 0.0013


def test_keys_refuse_a_secret_another_tool_keeps() -> None:
    from kvfleet_cli.keys_cmds import kept_elsewhere

    applied = {
        "metadata": {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}}
    }
    assert kept_elsewhere(applied) == "kubectl apply (its last-applied-configuration annotation)"
    argo = {"metadata": {"managedFields": [{"manager": "argocd-controller", "operation": "Apply"}]}}
    assert kept_elsewhere(argo) == "a server-side apply by 'argocd-controller'"
    helm = {"metadata": {"annotations": {"meta.helm.sh/release-name": "keys"}}}
    assert kept_elsewhere(helm) == "the Helm release 'keys'"
    writers = [{"manager": m, "operation": "Update"} for m in ("kvfleet-keys", "kubectl-create")]
    ours = {"metadata": {"managedFields": writers}}
    assert kept_elsewhere(ours) is None  # made by `kvfleet keys create` or `kubectl create`


def _example_gateway_config(name: str) -> Any:
    """The gateway config the operator renders for an example (what its ConfigMap holds)."""
    import yaml

    from kvfleet_gateway.config import GatewayConfig
    from kvfleet_operator.render import owner_of, render_children
    from kvfleet_operator.render.gateway import CONFIG_KEY
    from tests.support.objects import example

    (doc,) = [d for d in example(name) if d["kind"] == "InferenceService"]
    (cm,) = [c for c in render_children(owner_of(doc)) if c["kind"] == "ConfigMap"
             and CONFIG_KEY in (c.get("data") or {})]  # fmt: skip
    return GatewayConfig.from_dict(yaml.safe_load(cm["data"][CONFIG_KEY]))


def test_keys_list_shows_the_limits_in_force_and_where_each_comes_from() -> None:
    """search-team has no limits in the Secret, but the spec's tenant entry gives it 500M
    tokens / 30 days and 128 concurrent over the spec's defaults: that is what the gateway
    enforces, and what the listing says (it said `<defaults>`)."""
    import yaml

    from kvfleet_cli.keys_cmds import fingerprint
    from kvfleet_cli.keys_view import tenant_rows
    from tests.support.objects import example

    config = _example_gateway_config("llama-3.1-8b-h100-autoscaling.yaml")
    (secret,) = [d for d in example("api-keys-secret.yaml") if d["kind"] == "Secret"]
    doc = yaml.safe_load(secret["stringData"]["keys.yaml"])
    rows = {r[0]: r for r in tenant_rows(doc, config, fingerprint)}
    assert rows["search-team"][3] == (
        "600 requests/min (defaults), 128 concurrent (spec tenant), max_tokens <= 4,096"
        " (defaults), default max_tokens 512 (defaults), 500,000,000 tokens / 30d budget"
        " (spec tenant)"
    )
    assert rows["chat-app"][3].startswith("60 requests/min (secret), 32 concurrent (defaults)")
    assert rows["chat-app"][3].endswith("1,000,000 tokens / 1d budget (secret)")
    # Without the service's config: the Secret's own, and that the rest is the service's.
    assert tenant_rows(doc, None, fingerprint)[0][3] == "the rest: the service's (give --service)"


def test_keys_list_marks_an_entry_the_gateway_refuses_and_validate_names_the_field(
    tmp_path: Path,
) -> None:
    """A typo (`requestPerMinute`) crash-loops a gateway; the listing showed the entry as
    valid. It is marked INVALID with the field; `keys validate -f` says so before applying
    (exit 1), and passes a good file or manifest."""
    from kvfleet_cli.keys_cmds import fingerprint
    from kvfleet_cli.keys_view import tenant_rows
    from tests.support.objects import ROOT

    bad = {"tenants": [{"name": "a", "keys": [], "limits": {"requestPerMinute": 60}},
                       {"name": "b", "keys": ["sha256:" + "0" * 64]}]}  # fmt: skip
    rows = tenant_rows(bad, None, fingerprint)
    assert rows[0][3] == "INVALID limits.requestPerMinute: unknown field"
    assert not rows[1][3].startswith("INVALID")
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: [{name: a, limits: {requestPerMinute: 60}}]\n")
    said = CliRunner().invoke(cli, ["keys", "validate", "-f", str(path)])
    assert said.exit_code == 1, said.output
    assert f"{path}: tenants[0].limits.requestPerMinute: unknown field" in said.output
    said = CliRunner().invoke(
        cli, ["keys", "validate", "-f", str(ROOT / "examples" / "api-keys-secret.yaml")]
    )
    assert said.exit_code == 0, said.output
    assert "secret ai-api-keys keys.yaml: valid (2 tenants, 2 keys)" in said.output


def test_the_kubectl_plugin_says_kubectl_kvfleet_and_shells_complete() -> None:
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    help_text = subprocess.run(
        [bin_dir / "kubectl-kvfleet", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert help_text.startswith("Usage: kubectl kvfleet [OPTIONS] COMMAND")
    commands = [line.split()[0] for line in help_text.split("Commands:")[1].strip().splitlines()]
    assert commands == ["get", "describe", "logs", "top", "usage", "keys"], help_text
    words = subprocess.run(
        [bin_dir / "kubectl_complete-kvfleet", "to"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert words == ["top", ":4"]  # kubectl's plugin-completion protocol
    for shell, marker in (("bash", "complete -o nosort"), ("zsh", "#compdef kvfleet"),
                          ("fish", "complete --no-files --command kvfleet")):  # fmt: skip
        script = subprocess.run(
            [bin_dir / "kvfleet", "completion", shell], capture_output=True, text=True, check=True
        ).stdout
        assert marker in script and "_KVFLEET_COMPLETE" in script, script
    env = {"_KVFLEET_COMPLETE": "bash_complete", "COMP_WORDS": "kvfleet des", "COMP_CWORD": "1"}
    offered = subprocess.run(
        [bin_dir / "kvfleet"], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert offered.split() == ["plain,describe"]


def test_the_demo_timeline_legends_name_every_line() -> None:
    """Each panel's legend names every series drawn on it, the twin axis's too, the burst
    band and both kinds of decision line (the queue and the 429 bars were missing)."""
    import matplotlib.pyplot as plt

    from kvfleet_bench.demo.timeline import Decision, Run, Sample, figure

    run = Run(burst=(2.0, 5.0))
    run.samples = [Sample(float(i), 1 + (i > 3), 1, 1 + (i > 3), i % 3, 0.1, 0.4, 50.0, i, i // 2)
                   for i in range(8)]  # fmt: skip
    run.decisions = [Decision(3.0, "ScaledUp: queue 4"), Decision(6.0, "ScaledDown: idle")]
    fig = figure(run)
    try:
        legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes[:3]]
        renderer = fig.canvas.get_renderer()
        inside = fig.bbox
        for ax in fig.axes:  # every axis label is drawn inside the figure (not clipped)
            for label in (ax.yaxis.label, ax.xaxis.label):
                if label.get_text():
                    box = label.get_window_extent(renderer)
                    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, label.get_text()
    finally:
        plt.close(fig)
    common = ["burst phase", "scale up / warm promoted", "scale down"]
    assert legends[0] == ["active (serving)", "warm (loaded spare)", "desired active", *common]
    assert legends[1] == ["TTFT p50 (10 s)", "TTFT p99 (10 s)", "queued (right)", *common]
    assert legends[2] == ["output tokens/s", "429/s (right)", *common]


def test_the_demo_timeline_has_whole_replicas_and_a_visible_burst() -> None:
    """The replica panel's axis had half ticks (2.5 replicas), and its filled areas hid the
    burst's shading drawn beneath them: whole ticks only, and a band over the data."""
    import matplotlib.pyplot as plt

    from kvfleet_bench.demo.timeline import Run, Sample, figure

    run = Run(burst=(2.0, 5.0))
    # 3 replicas at most: matplotlib's default locator ticked 0, 0.5, 1, ... 3.5.
    run.samples = [Sample(float(i), 1 + (i > 3), int(i < 5), 2, 0, 0.1, 0.4, 50.0, i, 0)
                   for i in range(8)]  # fmt: skip
    fig = figure(run)
    try:
        ax1 = fig.axes[0]
        ticks = [v for v in ax1.get_yticks() if ax1.get_ylim()[0] <= v <= ax1.get_ylim()[1]]
        assert ticks and all(float(v).is_integer() for v in ticks), ticks
        top = max(c.get_zorder() for c in ax1.collections)  # the stacked areas
        over = [p for p in ax1.patches if p.get_zorder() > top]  # spans are patches
        assert len(over) == 1 and over[0].get_x() == 2.0, over
    finally:
        plt.close(fig)


def test_the_demo_budget_check_holds_per_period_and_can_fail() -> None:
    """A daily budget starts again at midnight UTC: a demo that runs across it bills more than
    one period's budget in total and still held (a CI run failed so); within one period, more
    than the budget is a failure."""
    from kvfleet_bench.demo.timeline import Run, TenantStats

    def held(bills: list[tuple[int, int]]) -> tuple[bool, str]:
        trial = TenantStats(budget=7_200, refused={"insufficient_quota": 3})
        for tokens, period_end in bills:
            trial.bill(tokens, period_end)
        return Run().checks({"trial": trial})["the budget held"]

    ok, why = held([(7_000, 86_400), (592, 172_800)])
    assert ok, why
    assert why == (
        "trial: 7,592 tokens billed over 2 budget periods (7,000 and 592 of 7,200), "
        "3 refused insufficient_quota"
    )
    ok, why = held([(7_000, 86_400), (592, 86_400)])
    assert not ok and why.startswith("trial: 7,592 of 7,200 tokens billed"), why


def test_a_taken_port_is_one_line_naming_the_port_and_its_flag(tmp_path: Path) -> None:
    """`kvfleet gateway --port 8080` with 8080, or the metrics port (9090, Prometheus's
    default), taken: it died with a 40-line traceback. Now one line, the port, the flag."""
    import socket

    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: []\n")
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        busy, other = taken.getsockname()[1], free.getsockname()[1]
        free.close()  # a port nothing listens on
        base = ["gateway", "--backend", "http://127.0.0.1:1", "--host", "127.0.0.1",
                "--keys", str(keys)]  # fmt: skip
        for flags, flag in (
            (["--port", str(busy), "--metrics-port", str(other)], "--port"),
            (["--port", str(other), "--metrics-port", str(busy)], "--metrics-port"),
        ):
            said = CliRunner().invoke(cli, [*base, *flags])
            assert said.exit_code == 1, said.output
            assert said.exception is None or isinstance(said.exception, SystemExit)
            (line,) = [x for x in said.output.splitlines() if x.startswith("Error:")]
            assert line == (
                f"Error: port {busy} on 127.0.0.1 is in use: choose another with {flag} PORT"
                f" (or listen.{'port' if flag == '--port' else 'metricsPort'} in --config)"
            )
            assert "Traceback" not in said.output


def test_the_operator_refuses_a_taken_metrics_port_at_start(tmp_path: Path) -> None:
    """Another operator on the host held 8081: kopf retried the bind each minute and the
    operator reconciled nothing, silently, for as long as it ran. Now it stops at once."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text("apiVersion: v1\nkind: Config\n")  # never read: refused before
        args = ["operator", "--metrics-port", str(busy), "--kubeconfig", str(kubeconfig)]
        said = CliRunner().invoke(cli, args)
    assert said.exit_code == 1, said.output
    (line,) = [x for x in said.output.splitlines() if x.startswith("Error:")]
    assert line == (
        f"Error: port {busy} on 0.0.0.0 is in use: choose another with --metrics-port PORT"
    )


def test_sim_cost_model_flag_picks_the_truth() -> None:
    """--cost-model: measured GPU timings where profiled (auto, the default), the roofline, or
    measured alone, which an unprofiled pair refuses."""
    runner = CliRunner()
    base = ["sim", "offline", "--model", "llama-3.1-8b", "--num-prompts", "32", "--json"]

    def tok_s(*extra: str) -> float:
        r = runner.invoke(cli, [*base, *extra])
        assert r.exit_code == 0, r.output
        return float(json.loads(r.output.strip().splitlines()[-1])["output_throughput"])

    auto = tok_s("--gpu", "a100-80g")
    assert auto == tok_s("--gpu", "a100-80g", "--cost-model", "measured")
    assert auto != tok_s("--gpu", "a100-80g", "--cost-model", "roofline")
    r = runner.invoke(cli, [*base, "--gpu", "h100", "--cost-model", "measured"])
    assert r.exit_code != 0 and "no measured GPU timings for llama-3.1-8b on h100" in r.output
