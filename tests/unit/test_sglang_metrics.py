"""One reader of SGLang's /metrics (`kvfleet_kernel.sglang_metrics`) for the gateway, the
operator and `kvfleet top`: counts add up over label sets (data-parallel ranks), ratios
average — `kvfleet top` once showed 140% KV usage for two ranks at 70%."""

from __future__ import annotations

from kvfleet_gateway.signals import parse_metrics
from kvfleet_kernel.sglang_metrics import promql, read_gauges
from kvfleet_operator.scaling.observe import parse_engine

TWO_RANKS = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",tp_rank="0"} 4.0
sglang:num_running_reqs{dp_rank="0",model_name="m"} 10.0
sglang:num_running_reqs{dp_rank="1",model_name="m"} 12.0
sglang:token_usage{dp_rank="0",model_name="m"} 0.7
sglang:token_usage{dp_rank="1",model_name="m"} 0.7
sglang:cache_hit_rate{dp_rank="0",model_name="m"} 0.5
sglang:cache_hit_rate{dp_rank="1",model_name="m"} 0.25
sglang_max_total_num_tokens{dp_rank="0",model_name="m"} 1000.0
sglang_max_total_num_tokens{dp_rank="1",model_name="m"} 1000.0
sglang:prompt_tokens_total{model_name="m"} 123.0
sglang:num_queue_reqs_created 17.0
"""


def test_counts_add_up_and_ratios_average_over_ranks() -> None:
    g = read_gauges(TWO_RANKS)
    assert g["num_queue_reqs"] == 7 and g["num_running_reqs"] == 22
    assert g["token_usage"] == 0.7 and g["cache_hit_rate"] == 0.375
    assert g["max_total_num_tokens"] == 2000  # both spellings of the name
    assert "prompt_tokens_total" not in g and "gen_throughput" not in g


def test_the_gateway_and_the_operator_read_the_same_numbers() -> None:
    signals = parse_metrics(TWO_RANKS)
    pod = parse_engine(TWO_RANKS, at=5.0)
    assert signals is not None and pod is not None
    assert (signals.queue_reqs, signals.running_reqs, signals.token_usage) == (7, 22, 0.7)
    assert (pod.queue, pod.running, pod.kv_usage) == (7, 22, 0.7)
    assert parse_metrics("sglang:num_running_reqs 1\n") is None  # no queue gauge: not an engine


def test_promql_combines_as_the_reader_does() -> None:
    assert promql("token_usage", "pod", 'namespace="ai"') == (
        'avg by (pod) ({__name__=~"sglang[:_]token_usage", namespace="ai"})'
    )
    assert promql("num_queue_reqs", "namespace, pod").startswith("sum by (namespace, pod) (")
