"""SGLang's KV events end to end without sockets: the simulator's radix cache reports what it
stores and evicts, in SGLang's wire format; the gateway decodes it, hashes prompts the same
way, keeps an exact index, and follows a stream through gaps, replays and restarts."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvfleet_gateway.config import ConfigError, GatewayConfig
from kvfleet_gateway.kv_events.hashing import page_hashes
from kvfleet_gateway.kv_events.prompts import PromptTokenizer
from kvfleet_gateway.kv_events.streams import Publisher, StreamState
from kvfleet_gateway.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
)
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.routing import Candidate, EventIndex, RouteRequest
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy
from kvfleet_sim.api import render_chat
from kvfleet_sim.kv_events import KvEventsConfig, event_hash, namespace_seed, page_digests
from kvfleet_sim.radix import RadixCache
from kvfleet_sim.tokenizer import HfTokenizer

TOKENIZER = Path(__file__).parents[1] / "data" / "tokenizers" / "tiny-chat"


def sglang_hash(ids: list[int], page: int) -> list[int]:
    """SGLang's hash_binding.cpp + hash_str_to_int64, restated from its source."""
    out, prior = [], b""
    for start in range(0, len(ids) - len(ids) % page, page):
        digest = hashlib.sha256(prior + struct.pack(f"<{page}I", *ids[start : start + page]))
        prior = digest.digest()
        value = int(digest.hexdigest()[:16], 16)
        out.append(value - 2**64 if value >= 2**63 else value)
    return out


@pytest.mark.parametrize("page", [1, 16])
def test_gateway_and_engine_name_pages_as_sglang_does(page: int) -> None:
    ids = list(range(1000, 1000 + 70))
    expected = sglang_hash(ids, page)
    assert list(page_hashes(ids, page)) == expected
    assert [event_hash(d) for d in page_digests(None, ids, page)] == expected
    # the chain continues from a parent's last digest, as a child node's pages do
    head = page_digests(None, ids[:32], page)
    tail = page_digests(head[-1], ids[32:], page)
    assert [event_hash(d) for d in head + tail] == expected
    assert len(expected) == 70 // page  # a trailing partial page has no hash


class Recorder:
    """A CacheEventSink that keeps the events in SGLang's wire shape (dicts)."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.events: list[dict[str, Any]] = []

    def digests(self, prior: bytes | None, tokens: Any) -> list[bytes]:
        return page_digests(prior, tokens, self.page)

    def namespace_seed(self, salt: str) -> bytes:
        return namespace_seed(salt)

    def stored(
        self, parent: bytes | None, digests: list[bytes], tokens: Any, salt: str | None = None
    ) -> None:
        self.events.append(
            {
                "type": "BlockStored",
                "block_hashes": [event_hash(d) for d in digests],
                "parent": event_hash(parent) if parent else None,
            }
        )

    def removed(self, digests: list[bytes]) -> None:
        self.events.append(
            {"type": "BlockRemoved", "block_hashes": [event_hash(d) for d in digests]}
        )

    def cleared(self) -> None:
        self.events.append({"type": "AllBlocksCleared"})


def test_radix_cache_reports_stores_splits_and_evictions() -> None:
    cache = RadixCache(page_size=4)
    rec = Recorder(4)
    cache.events = rec
    a = list(range(16))
    b = list(range(8)) + [99] * 8  # shares two pages with a
    cache.insert(a)
    cache.insert(b)  # splits a's node after 8 tokens, stores b's own two pages
    first, second = rec.events
    assert first["block_hashes"] == sglang_hash(a, 4) and first["parent"] is None
    assert second["block_hashes"] == sglang_hash(b, 4)[2:]
    assert second["parent"] == sglang_hash(a, 4)[1]  # linked to the shared page
    cache.evict(24)  # both leaves, then the shared node they leave childless
    removed = {h for e in rec.events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert removed == set(sglang_hash(a, 4)) | set(sglang_hash(b, 4))
    cache.insert(a)
    cache.reset()
    assert rec.events[-1] == {"type": "AllBlocksCleared"}


def test_published_bytes_have_sglangs_shape_and_decode_in_the_gateway() -> None:
    from kvfleet_sim.kv_events import ZmqKvEventPublisher

    publisher = ZmqKvEventPublisher.__new__(ZmqKvEventPublisher)  # no sockets: encode only
    publisher.page_size, publisher._events = 2, []
    digests = page_digests(None, [5, 6, 7, 8], 2)
    publisher.stored(None, digests, [5, 6, 7, 8])
    publisher.removed(digests[1:])
    publisher.cleared()
    batch = [1.5, publisher._events, 0]
    raw = msgspec.msgpack.encode(batch)
    # SGLang's EventBatch is array_like [ts, events, attn_dp_rank]; events are maps tagged by
    # "type", optional fields at their default omitted (lora_id has no default: always sent).
    plain = msgspec.msgpack.decode(raw)
    assert plain[0] == 1.5 and plain[2] == 0
    assert plain[1][0] == {
        "type": "BlockStored",
        "block_hashes": [event_hash(d) for d in digests],
        "parent_block_hash": None,
        "token_ids": [5, 6, 7, 8],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    decoded = decode_batch(raw)
    stored, removed, cleared = decoded.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == sglang_hash([5, 6, 7, 8], 2)
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([0.0, list(events), 0])


def stored(*hashes: int, **extra: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 1,
        "lora_id": None,
        **extra,
    }


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes)}


def stream(replay: bool = True) -> tuple[StreamState, EventIndex]:
    index = EventIndex()
    return StreamState("http://e1", 1, index, GatewayMetrics(), replay), index


def test_a_stream_replays_from_zero_on_connect_and_is_live_after_the_replay() -> None:
    state, index = stream()
    index.stored("http://e1", [42])  # stale: from before the (re)connect
    assert state.connected() == 0
    assert not index.is_live("http://e1") and index.pages_held("http://e1") == 0
    state.replayed(0, batch(stored(1, 2, 3)))
    state.replayed(1, batch(removed(3)))
    assert state.message(1, batch(removed(3))) is None  # the live copy of a replayed batch
    state.replayed(END_SEQ, b"")
    assert index.is_live("http://e1")
    assert index.match([1, 2, 3], 1, ["http://e1"]) == [2]
    assert index.match([1, 2], 2, ["http://e1"]) == [None]  # pages of another size: unknown


def test_a_gap_asks_for_a_replay_and_a_rolled_over_buffer_is_partial() -> None:
    state, index = stream()
    state.connected()
    state.replayed(END_SEQ, b"")
    assert state.message(0, batch(stored(1))) is None
    assert state.message(3, batch(stored(4))) == 1  # 1 and 2 are missing: replay from 1
    state.replayed(1, batch(stored(2)))
    state.replayed(2, batch(stored(3)))
    state.replayed(3, batch(stored(4)))
    state.replayed(END_SEQ, b"")
    assert index.match([1, 2, 3, 4], 1, ["http://e1"]) == [4] and not state.partial
    # the engine restarted unseen and its buffer starts later than asked: partial, but live
    state.connected()
    state.replayed(5, batch(stored(9)))
    state.replayed(END_SEQ, b"")
    assert state.partial and index.is_live("http://e1")
    assert index.match([1], 1, ["http://e1"]) == [0] and index.match([9], 1, ["http://e1"]) == [1]


def test_a_dropped_stream_forgets_its_pages_and_routing_falls_back() -> None:
    state, index = stream(replay=False)
    state.connected()  # without a replay socket: live at once, from what comes next
    state.message(7, batch(stored(1, 2)))
    assert index.match([1, 2], 1, ["http://e1"]) == [2]
    state.disconnected()
    assert index.match([1, 2], 1, ["http://e1"]) == [None]
    assert index.distinct_pages() == 0


def test_salted_pages_are_indexed_adapter_and_host_tier_pages_are_not() -> None:
    """A salted page's hash already chains from its salt (the gateway hashes a salted prompt
    the same way): indexed as published. Adapter and host-tier pages: not."""
    state, index = stream(replay=False)
    state.connected()
    state.message(
        0,
        batch(stored(1, cache_salt="tenant-a"), stored(2, medium="CPU_PINNED"),
              stored(3, lora_name="adapter")),
    )  # fmt: skip
    assert index.distinct_pages() == 1
    assert index.match([1], 1, ["http://e1"]) == [1]


def test_the_event_index_overrides_what_routing_history_believes() -> None:
    events = EventIndex()
    policy = KvfleetPolicy(events=events)
    a, b = "http://a", "http://b"
    for key in (a, b):
        events.set_live(key, 16)
    pages = tuple(range(100, 164))  # 1,024 tokens
    req = RouteRequest("m", "", (), 1024, 16, pages=pages, page_tokens=16)
    cands = [Candidate(a, 0, 0, None), Candidate(b, 0, 0, None)]
    assert policy.choose(req, cands) == a  # nothing cached anywhere: the tie-break
    policy.on_first_token(req, a)
    policy.on_finished(req, a)
    events.stored(b, pages)  # b holds the prefix (a request that went there directly) ...
    # ... and a never reported it: the approximate index says a, the events say b
    again = RouteRequest("m", "", (), 1024, 16, pages=pages, page_tokens=16)
    assert policy.choose(again, cands) == b


def test_pages_in_flight_count_until_the_first_token() -> None:
    index = EventIndex()
    index.set_live("a", 1)
    index.reserve("a", [1, 2, 3])
    index.reserve("a", [1, 2])
    assert index.match([1, 2, 3], 1, ["a"]) == [3]
    index.release("a", [1, 2, 3])
    assert index.match([1, 2, 3], 1, ["a"]) == [2]
    index.release("a", [1, 2])
    assert index.match([1, 2, 3], 1, ["a"]) == [0]
    index.reserve("a", [5])
    index.remove("a")
    assert index._inflight == {} and index._inflight_refs == {}


def test_gateway_tokenizes_chat_exactly_as_the_engine_does() -> None:
    gateway = PromptTokenizer.load(str(TOKENIZER))
    engine = HfTokenizer.load(str(TOKENIZER))
    messages = [("system", "You are a helpful assistant."), ("user", "Where is my order?")]
    text = render_chat([{"role": r, "content": c} for r, c in messages])
    assert gateway.chat_ids(messages) == engine.encode(text, add_special_tokens=False)
    assert gateway.text_ids("the quick brown fox") == engine.encode("the quick brown fox")


def test_publisher_discovery_and_config_rules() -> None:
    info = {
        "kv_events": KvEventsConfig.from_cli(
            '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}'
        ).describe(16)
    }
    assert Publisher.from_server_info(info) == Publisher(5557, "kv", 16, 5558, 1)
    assert Publisher.from_server_info({"kv_events": None}) is None
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        GatewayConfig.from_dict(
            {
                "backends": {"static": ["http://e:1"]},
                "auth": {"insecureNoAuth": True},
                "routing": {"prefixIndex": {"source": "events"}},
            }
        )
    with pytest.raises(ConfigError, match="read by the kvfleet policy only"):
        GatewayConfig.from_dict(
            {
                "backends": {"static": ["http://e:1"]},
                "auth": {"insecureNoAuth": True},
                "routing": {
                    "policy": "round_robin",
                    "prefixIndex": {"source": "events", "tokenizer": str(TOKENIZER)},
                },
            }
        )


def test_bisection_finds_every_replicas_prefix_length() -> None:
    """held_prefixes relies on a radix cache's prefix property; on such sets it agrees with a
    page-by-page walk, whichever of the stored and in-flight maps holds each page."""
    import random

    from kvfleet_gateway.routing.event_index import held_prefixes

    rng = random.Random(1)
    for _ in range(2000):
        n = rng.randrange(0, 40)
        pages = list(range(1000, 1000 + n))
        slots = list(range(rng.randrange(1, 10)))
        depths = {s: rng.randrange(0, n + 1) for s in slots}
        holders: dict[int, int] = {}
        inflight: dict[int, int] = {}
        for s, d in depths.items():
            for i in range(d):
                target = holders if rng.random() < 0.7 else inflight
                target[pages[i]] = target.get(pages[i], 0) | 1 << s
        assert held_prefixes(holders, inflight, pages, slots) == [depths[s] for s in slots]


async def test_fetch_tokenizer_from_a_hub(tmp_path: Path) -> None:
    """The gateway's init container against a Hub-compatible server (HF_ENDPOINT): the
    tokenizer files of a revision, the token sent, optional files skipped, a gated model's
    refusal said plainly."""
    from aiohttp import web

    from kvfleet_gateway.kv_events.hub import HubError, fetch_tokenizer
    from kvfleet_sim.procs import free_port

    seen: list[tuple[str, str | None]] = []

    async def resolve(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.match_info["repo"] == "gated":
            return web.Response(status=401)
        name = request.match_info["name"]
        if not (TOKENIZER / name).exists():
            return web.Response(status=404)
        return web.Response(body=(TOKENIZER / name).read_bytes())

    app = web.Application()
    app.router.add_get("/{org}/{repo}/resolve/{revision}/{name}", resolve)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        hub = f"http://127.0.0.1:{port}"
        dest = tmp_path / "tok"
        written = await fetch_tokenizer("org/model", dest, "v1.0", hub, "hf_secret")
        assert written == ["tokenizer.json", "tokenizer_config.json"]  # no chat_template.jinja
        assert seen[0] == ("/org/model/resolve/v1.0/tokenizer.json", "Bearer hf_secret")
        loaded = PromptTokenizer.load(str(dest))
        assert loaded.text_ids("the farm") == PromptTokenizer.load(str(TOKENIZER)).text_ids(
            "the farm"
        )
        with pytest.raises(HubError, match="gated or private model needs HF_TOKEN"):
            await fetch_tokenizer("org/gated", tmp_path / "gated", None, hub)
    finally:
        await runner.cleanup()


def test_a_gateway_without_a_usable_tokenizer_refuses_to_start(tmp_path: Path) -> None:
    from kvfleet_gateway.app import make_app

    (tmp_path / "tokenizer.json").write_text("{not json")
    config = GatewayConfig.from_dict(
        {
            "backends": {"static": ["http://127.0.0.1:1"]},
            "auth": {"insecureNoAuth": True},
            "routing": {"prefixIndex": {"source": "events", "tokenizer": str(tmp_path)}},
        }
    )
    with pytest.raises(ConfigError, match=r"prefixIndex\.tokenizer: .* is not a tokenizer"):
        make_app(config)


CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\\n<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("template", [None, CHATML], ids=["llama3", "chatml"])
def test_gateway_tokenizes_as_transformers_does(template: str | None, tmp_path: Path) -> None:
    """The reference SGLang itself uses: `AutoTokenizer.apply_chat_template` (tokenize=True,
    add_generation_prompt=True) and `tokenizer(text)`, on the same files."""
    import json as json_

    pytest.importorskip("transformers", reason="transformers is a dev dependency (make setup)")
    from transformers import AutoTokenizer

    directory = TOKENIZER
    if template is not None:
        directory = tmp_path / "chatml"
        directory.mkdir()
        (directory / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
        config = json_.loads((TOKENIZER / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(
            json_.dumps({**config, "chat_template": template})
        )
    reference = AutoTokenizer.from_pretrained(str(directory))
    ours = PromptTokenizer.load(str(directory))
    for messages in (
        [("user", "Where is my order?")],
        [("system", "You are a helpful assistant for an online store."), ("user", " Hi!\n"),
         ("assistant", "Hello. How can I help?"), ("user", "Where is my order?")],
    ):  # fmt: skip
        expected = reference.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            tokenize=True,
            add_generation_prompt=True,
        )
        if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
            expected = expected["input_ids"]
        assert ours.chat_ids(messages) == expected
    text = "the quick brown fox jumps over the lazy dog"
    assert ours.text_ids(text) == reference(text)["input_ids"]
    if template is not None:  # the template's own refusal: approximate routing, not an error
        assert ours.chat_ids([("tool", "x")]) is None
