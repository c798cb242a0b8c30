"""The gateway config contract: typed, validated once, errors that name the field, round trip."""

from pathlib import Path

import pytest
import yaml

from kvfleet_gateway.config import ConfigError, Duration, GatewayConfig, load_config
from kvfleet_gateway.keys import KeyRing, hash_key

FULL = """
listen: {host: 127.0.0.1, port: 9000}
models: [{name: llama-3.1-8b, contextLength: 8192}, {name: qwen}]
backends:
  static: [http://10.0.0.1:30000/, http://10.0.0.2:30000]
routing: {policy: kvfleet, tuning: {prefillTokensPerSecond: 30000}}
auth: {keysFile: /etc/kvfleet/keys.yaml}
limits:
  store: redis://redis:6379/0
  defaults:
    requestsPerMinute: 600
    tokensPerMinute: 200000
    maxConcurrent: 16
    maxTokens: 4096
    defaultMaxTokens: 512
    tokenBudget: {tokens: 10000000, period: 30d}
  tenants:
    - name: team-a
      limits: {maxConcurrent: 64}
  redisOutage: {gatewayReplicas: 3}
cost: {gpuHourlyPrice: 4.5, gpusPerReplica: 2}
timeouts: {firstByte: 2m, idle: 30s}
"""


def test_full_document_parses_into_typed_values() -> None:
    c = GatewayConfig.from_dict(yaml.safe_load(FULL))
    assert (c.listen.host, c.listen.port) == ("127.0.0.1", 9000)
    assert c.backends.static == ("http://10.0.0.1:30000", "http://10.0.0.2:30000")
    assert c.models[0].context_length == 8192 and c.models[1].name == "qwen"
    assert c.limits.defaults.token_budget is not None
    assert c.limits.defaults.token_budget.period == 30 * 86400
    assert c.limits.redis_outage.gateway_replicas == 3 and c.cost.gpus_per_replica == 2
    assert c.timeouts.first_byte == 120 and c.timeouts.idle == 30
    assert c.routing.tuning.prefill_tokens_per_second == 30000
    team = c.limits_for("team-a")
    assert team.max_concurrent == 64 and team.requests_per_minute == 600


def test_round_trip_is_exact() -> None:
    c = GatewayConfig.from_dict(yaml.safe_load(FULL))
    again = GatewayConfig.from_dict(yaml.safe_load(yaml.safe_dump(c.to_dict())))
    assert again == c


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"limits": {"defaults": {"maxConcurrent": 0}}}, "limits.defaults.maxConcurrent"),
        (
            {"limits": {"defaults": {"tokenBudget": {"tokens": 5, "period": "3x"}}}},
            "limits.defaults.tokenBudget.period: '3x' is not a duration",
        ),
        ({"limits": {"tenants": [{"limits": {}}]}}, "limits.tenants[0].name: required"),
        ({"limits": {"store": "postgres://x"}}, "limits.store"),
        ({"backends": {"static": ["10.0.0.1:30000"]}}, "backends.static[0]"),
        ({"backends": {}}, "backends: give static URLs"),
        ({"routing": {"policy": "fastest"}}, "routing.policy: 'fastest' is not one of kvfleet"),
        ({"listen": {"port": "80"}}, "listen.port"),
        ({"auth": {}}, "auth.keysFile: auth.keysFile is required"),
        ({"limtis": {}}, "limtis: unknown field"),
        ({"limits": {"defaults": {"maxTokens": 10, "defaultMaxTokens": 20}}}, "defaultMaxTokens"),
        # Issue 55, finding 7: a negative price was budget credit.
        (
            {"models": [{"name": "m", "price": {"prompt": 1, "output": 1, "cached": -1e6}}]},
            "models[0].price.cached: -1000000.0 is below the minimum 0",
        ),
        (
            {"models": [{"name": "m", "price": {"prompt": -1, "output": 1}}]},
            "models[0].price.prompt: -1.0 is below the minimum 0",
        ),
        # Issue 55, finding 6: an alias `<base>:<adapter>` claimed another service's adapter.
        ({"models": [{"name": "m", "aliases": ["llama-3.1-8b:sql"]}]}, "models[0].aliases[0]"),
        ({"models": [{"name": "llama:sql"}]}, "models[0].name"),
    ],
)
def test_errors_name_the_field(patch: dict[str, object], message: str) -> None:
    doc = {"backends": {"static": ["http://e:30000"]}, "auth": {"keysFile": "/k"}}
    for key, value in patch.items():
        doc[key] = value  # type: ignore[assignment]
    with pytest.raises(ConfigError) as err:
        GatewayConfig.from_dict(doc)
    assert message in str(err.value)


def test_load_config_reports_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("listen: [unclosed")
    # The file and where in it, never PyYAML's "<unicode string>".
    with pytest.raises(ConfigError, match=r"bad\.yaml.*invalid YAML at line 1, column 18") as err:
        load_config(f)
    assert "unicode string" not in str(err.value)
    f.write_text("auth: {insecureNoAuth: true}")
    with pytest.raises(ConfigError, match=r"bad\.yaml: backends: give backends \(one pool\)"):
        load_config(f)


def test_durations() -> None:
    assert Duration.parse("1h", "x") == 3600 and Duration.parse(90, "x") == 90
    assert str(Duration(86400 * 30)) == "30d" and str(Duration(1.5)) == "1.5s"
    with pytest.raises(ConfigError):
        Duration.parse("0d", "x")


def test_the_crd_limits_are_the_gateway_limits() -> None:
    """One model: what the CRD accepts in spec.gateway.defaultLimits is what the gateway reads."""
    from kvfleet_gateway.config import Limits
    from kvfleet_kernel.schema import openapi
    from kvfleet_operator.crd import crd

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    gateway = spec["properties"]["gateway"]["properties"]
    assert gateway["defaultLimits"]["properties"] == openapi(Limits)["properties"]
    tenant = gateway["tenants"]["items"]["properties"]["limits"]
    assert tenant["properties"] == openapi(Limits)["properties"]
    assert gateway["routingPolicy"]["enum"] == ["kvfleet", "round_robin", "least_load",
                                                "sglang_cache_aware", "random"]  # fmt: skip


def test_keys_are_hashes_and_raw_keys_are_never_echoed() -> None:
    ring = KeyRing.parse({"tenants": [{"name": "a", "keys": [hash_key("secret")]}]})
    assert ring.authenticate("secret") is not None
    assert ring.authenticate("Secret") is None
    with pytest.raises(ConfigError) as err:
        KeyRing.parse({"tenants": [{"name": "a", "keys": ["my-raw-key-123"]}]})
    assert "my-raw-key-123" not in str(err.value) and "sha256:" in str(err.value)
    with pytest.raises(ConfigError, match="appears twice"):
        KeyRing.parse({"tenants": [{"name": "a", "keys": []}, {"name": "a", "keys": []}]})


def test_a_name_several_pools_engines_report_is_routed_to_none() -> None:
    """Issue 55, finding 6: on a shared gateway, a name is routed to the one pool that
    claims it; an adapter name that the engines of two services both report (neither
    configured it) goes to neither, rather than to whichever pool comes first."""
    from kvfleet_gateway.backends import Backend
    from kvfleet_gateway.metrics import GatewayMetrics
    from kvfleet_gateway.pools import PoolSet

    pools = [
        {"name": f"ns/{n}", "models": [{"name": n}],
         "backends": {"static": [f"http://{n}:30000"]}}
        for n in ("a", "b")
    ]  # fmt: skip
    doc = {"auth": {"insecureNoAuth": True}, "pools": pools}
    pool_set = PoolSet(GatewayConfig.from_dict(doc), GatewayMetrics())
    for name, pool in pool_set.pools.items():
        backend = Backend(f"http://{name[3:]}:30000")
        backend.adapters = {"shared": name[3:], f"only-{name[3:]}": name[3:]}
        pool.backends.backends[backend.url] = backend
    found = pool_set.find("only-b")
    assert found is not None and found[0].name == "ns/b"
    assert pool_set.find("shared") is None
    assert pool_set.find("a:only-b") is None  # b's adapter never reaches a's engines
