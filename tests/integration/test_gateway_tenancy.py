"""Tenants that share a fleet do not share what they sent: the engines' prefix cache is
partitioned by a per-tenant cache salt (SGLang's `cache_salt`), over real HTTP against the
simulator's radix cache, and the gateway's prefix indexes key on the same salt."""

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet_gateway.config import CacheGroup, CacheIsolation
from kvfleet_gateway.keys import hash_key
from kvfleet_gateway.kv_events.hashing import page_hashes
from kvfleet_sim.kv_events import event_hash, namespace_seed, page_digests
from kvfleet_sim.radix import RadixCache
from tests.support.fake_engine import MODEL
from tests.support.gateway import gateway_config

CANDIDATES = ("aurora", "basilisk", "cobalt", "dunmore", "ember", "falconer")
KEYS = {"victim": "kvf-victim", "attacker": "kvf-attacker", "colleague": "kvf-colleague"}


def keys_file(tmp_path: Path) -> Path:
    tenants = [{"name": n, "keys": [hash_key(k)]} for n, k in KEYS.items()]
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


async def complete(s: aiohttp.ClientSession, gw: str, tenant: str, prompt: str) -> int:
    """The prompt's cached tokens, as the response reports them."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with s.post(f"{gw}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def guesses(gw: str, attacker: str = "attacker", trials: int = 8) -> int:
    """How often the attacker names the victim's secret codename from cached tokens alone."""
    rng = random.Random(7)
    right = 0
    async with aiohttp.ClientSession() as s:
        for trial in range(trials):
            secret = rng.choice(CANDIDATES)
            template = f"Trial {trial}. Internal memo about project {{}}: " + (
                "the launch plan, the budget and the people on it. " * 3
            )
            await complete(s, gw, "victim", template.format(secret))
            seen = [await complete(s, gw, attacker, template.format(c)) for c in CANDIDATES]
            right += CANDIDATES[seen.index(max(seen))] == secret
    return right


@pytest.mark.parametrize("mode", ["tenant", "shared"])
async def test_a_tenant_cannot_read_another_tenants_prompt_through_the_cache(
    mode: str, sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Round two, finding 3: through the shared cache a tenant guessed another's codename out
    of six candidates in 8 of 8 trials. Isolated (the default), no better than chance; shared
    (the setting that says so), the leak is still there — so this check can fail."""
    engine = await sim_server(time_scale=0.01)
    config = gateway_config([engine], keys_file(tmp_path))
    config = dataclasses.replace(config, cache_isolation=CacheIsolation(mode=mode))
    gw = await gateway_server(config)
    right = await guesses(gw)
    print(f"cache isolation {mode}: the codename guessed in {right} of 8 trials (chance: 1.3)")
    if mode == "tenant":
        assert right <= 2, right
    else:
        assert right >= 6, right


async def test_a_cache_group_shares_and_its_own_prompts_still_hit(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Tenants of one group share a namespace; an isolated tenant's own repeat hits."""
    engine = await sim_server(time_scale=0.01)
    groups = (CacheGroup(name="org", tenants=("victim", "colleague")),)
    config = gateway_config([engine], keys_file(tmp_path))
    config = dataclasses.replace(config, cache_isolation=CacheIsolation(groups=groups))
    gw = await gateway_server(config)
    prompt = "A long shared system prompt about the runbook. " * 8
    async with aiohttp.ClientSession() as s:
        assert await complete(s, gw, "victim", prompt) == 0
        assert await complete(s, gw, "victim", prompt) > 50  # its own cache
        assert await complete(s, gw, "colleague", prompt) > 50  # its group's
        assert await complete(s, gw, "attacker", prompt) == 0  # not the group's
    assert await guesses(gw, attacker="colleague") >= 6  # a group shares, by design


def test_salted_pages_hash_as_the_engine_publishes_them() -> None:
    """The gateway's page hashes of a salted prompt equal the engine's published ones (its
    radix cache chains them from the salt's seed); unsalted and other salts share none."""
    published: list[int] = []

    class Sink:
        def digests(self, prior: bytes | None, tokens: Any) -> list[bytes]:
            return page_digests(prior, tokens, 4)

        def namespace_seed(self, salt: str) -> bytes:
            return namespace_seed(salt)

        def stored(self, parent: Any, digests: list[bytes], tokens: Any, salt: Any) -> None:
            published.extend(event_hash(d) for d in digests)

        def removed(self, digests: list[bytes]) -> None: ...

        def cleared(self) -> None: ...

    cache = RadixCache(page_size=4)
    cache.events = Sink()
    ids = list(range(100, 116))
    cache.insert(ids, "kvf-a")
    assert published == list(page_hashes(ids, 4, "kvf-a"))
    others = set(page_hashes(ids, 4)) | set(page_hashes(ids, 4, "kvf-b"))
    assert not set(published) & others
    assert cache.match_prefix(ids, "kvf-b").length == 0  # another namespace holds nothing
    assert cache.match_prefix(ids, "kvf-a").length == 16
