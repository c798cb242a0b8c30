"""Precise prefix routing from SGLang's KV events, live: the real `kvfleet gateway` process in
front of real-time simulator engines publishing KV events over real ZeroMQ, driven with the
OpenAI SDK.

The scenario an approximate index gets wrong: the gateway sends prompt A to engine P; A also
reaches engine Q behind the gateway's back (another gateway replica, say); then memory
pressure on P evicts A. The approximate index still believes P holds A and knows nothing of
Q. The event index saw both: the next A must go to Q and hit its cache.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import yaml

from kvfleet_gateway.config import CacheIsolation, PrefixIndexConfig
from kvfleet_gateway.isolation import cache_salt
from kvfleet_sim.procs import free_port, running_process
from tests.conftest import SimProcesses
from tests.support.gateway import gateway_config, metrics_url
from tests.support.waiting import until_sync

TOKENIZER = Path(__file__).parents[1] / "data" / "tokenizers" / "tiny-chat"
WORDS = "the of and to in is it you that he was for on are as with his they at be this".split()
PAGE = 16
MODEL = "llama-3.1-8b"


def engine_flags() -> list[str]:
    events = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{free_port()}",
        "topic": "kv-events",
    }
    return [
        "--kv-events-config",
        json.dumps(events),
        "--tokenizer-path",
        str(TOKENIZER),
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        "3000",  # room for about four of these prompts: the fifth evicts the oldest
        "--time-scale",
        "0.05",
        "--no-eos",
    ]


def prompt(seed: int, words: int = 600) -> list[dict[str, str]]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "system", "content": text}, {"role": "user", "content": "Summarise."}]


GATEWAY_SALT = cache_salt(CacheIsolation(), "anonymous", None)
"""The cache salt the gateway sends for its (keyless) tenant: a request sent to an engine
directly must carry it to land in the same cache namespace."""


def ask(
    client: openai.OpenAI, messages: list[dict[str, str]], salt: str | None = None
) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one chat completion."""
    extra = {"cache_salt": salt} if salt else None
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body=extra)  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in requests.get(url, timeout=5).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def fleet(tmp_path: Path, sim_processes: SimProcesses) -> Iterator[Any]:
    def start(source: str) -> tuple[str, str, list[str]]:
        engines = [sim_processes(*engine_flags()), sim_processes(*engine_flags())]
        base = gateway_config(engines, health_interval=0.2, scrape_interval=0.2)
        config = replace(
            base,
            routing=replace(
                base.routing,
                prefix_index=PrefixIndexConfig(source=source, tokenizer=str(TOKENIZER)),  # type: ignore[arg-type]
            ),
        )
        port = free_port()
        path = tmp_path / f"gateway-{source}.yaml"
        doc = config.to_dict()
        doc["listen"]["port"] = port
        path.write_text(yaml.safe_dump(doc))
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(
            running_process(
                [sys.executable, "-m", "kvfleet_cli", "gateway", "--config", str(path)],
                ready_url=f"{url}/readyz",
                log_path=tmp_path / f"gateway-{source}.log",
            )
        )
        return url, metrics_url(config), engines

    with ExitStack() as stack:
        yield start


def served_by(engines: list[str]) -> str:
    """The engine that has prefilled anything (the others have not been asked yet)."""
    counts = {e: metric(f"{e}/metrics", "sglang:prompt_tokens_total") for e in engines}
    busy = [e for e, n in counts.items() if n > 0]
    assert len(busy) == 1, counts
    return busy[0]


@pytest.mark.parametrize(("source", "expect_hit"), [("events", True), ("approximate", False)])
def test_an_evicted_prefix_is_routed_by_the_updated_index(
    fleet: Any, source: str, expect_hit: bool
) -> None:
    gateway, gw_metrics, engines = fleet(source)
    if source == "events":  # both streams synchronised before the first request
        until_sync(
            lambda: metric(gw_metrics, "kvfleet_gateway_kv_event_streams_live") == 2,
            10,
            "both streams live",
        )
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    a = prompt(0)

    prompt_tokens, cached = ask(client, a)
    assert cached == 0 and prompt_tokens > 500
    p = served_by(engines)
    q = next(e for e in engines if e != p)
    # A reaches Q directly: only Q's events can tell the gateway.
    direct_q = openai.OpenAI(base_url=f"{q}/v1", api_key="unused", max_retries=0)
    assert ask(direct_q, a, GATEWAY_SALT)[1] == 0
    # Memory pressure on P: four other prompts of the same size evict A there.
    direct_p = openai.OpenAI(base_url=f"{p}/v1", api_key="unused", max_retries=0)
    for seed in range(1, 5):
        ask(direct_p, prompt(seed), GATEWAY_SALT)
    # the newest is cached: eviction took the oldest
    assert ask(direct_p, prompt(4), GATEWAY_SALT)[1] > 500
    if source == "events":
        until_sync(
            lambda: (
                metric(gw_metrics, "kvfleet_gateway_kv_events_total", backend=p, kind="removed") > 0
            ),
            5,
            "A removed on P",
        )
        time.sleep(0.3)  # the batch that removed A may be followed by stores in flight

    prompt_tokens, cached = ask(client, a)
    if expect_hit:  # routed to Q, where A is cached
        assert cached >= prompt_tokens - PAGE, (prompt_tokens, cached)
    else:  # the approximate index sent it back to P, which no longer holds it
        assert cached < PAGE, (prompt_tokens, cached)


async def test_a_stream_resyncs_after_a_restart_and_recovers_a_dropped_batch() -> None:
    """The gateway's follower against the simulator's publisher over real ZeroMQ: a restarted
    engine's old pages are forgotten, and a batch lost on the wire is replayed."""
    import asyncio

    import zmq.asyncio

    from kvfleet_gateway.kv_events.streams import Publisher, follow
    from kvfleet_gateway.metrics import GatewayMetrics
    from kvfleet_gateway.routing import EventIndex
    from kvfleet_sim.kv_events import KvEventsConfig, ZmqKvEventPublisher, event_hash, page_digests
    from tests.support.waiting import until

    pub_port, replay_port = free_port(), free_port()
    config = KvEventsConfig(
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv-events",
    )
    key = "http://127.0.0.1:1"
    index, ctx = EventIndex(), zmq.asyncio.Context()

    def publish(publisher: ZmqKvEventPublisher, tokens: list[int]) -> list[int]:
        digests = page_digests(None, tokens, 1)
        publisher.stored(None, digests, tokens, None)
        publisher.flush()
        return [event_hash(d) for d in digests]

    def held(pages: list[int]) -> bool:
        return index.match(pages, 1, [key]) == [len(pages)]

    first = ZmqKvEventPublisher(config, 1)
    old = publish(first, [1, 2, 3])  # before the gateway connects: only a replay has it
    follower = asyncio.create_task(
        follow(
            key, Publisher(pub_port, "kv-events", 1, replay_port, 1), index, GatewayMetrics(), ctx
        )
    )
    try:
        await until(lambda: held(old), 10, "the replayed pages")
        first.close()
        await until(lambda: not index.is_live(key), 10, "the stream to drop")
        assert index.match(old, 1, [key]) == [None]

        second = ZmqKvEventPublisher(config, 1)  # the engine restarted: an empty cache
        try:
            await until(lambda: index.is_live(key), 10, "the stream to resync")
            assert index.match(old, 1, [key]) == [0]
            sent = second._pub.send_multipart
            dropped: list[bytes] = []

            def lossy(frames: Any, *args: Any, **kw: Any) -> Any:
                if frames[1] == (1).to_bytes(8, "big") and not dropped:
                    dropped.append(frames[1])  # lost on the wire, still in the replay buffer
                    return None
                return sent(frames, *args, **kw)

            second._pub.send_multipart = lossy  # type: ignore[method-assign]
            pages = [publish(second, [10 + i, 20 + i]) for i in range(3)]
            await until(lambda: all(held(p) for p in pages), 10, "the lost batch's replay")
            assert dropped
        finally:
            second.close()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        ctx.term()
