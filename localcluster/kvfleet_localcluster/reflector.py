"""List-then-watch into a local copy, as client-go's reflector keeps an informer's store.

The node agent keeps three: the pods bound to its node (a server-side field selector), and
all pods and Services (for the Service table its pods resolve names from). Each change calls
`on_change`; a watch that ends is resumed from the last resource version, and a `410 Gone`
lists again, so the copy converges on the server's state whatever the network did.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kubeapi import KubeClient, Resource

log = logging.getLogger("kvfleet.node.reflector")
Json = dict[str, Any]
RETRY_S = 0.5


def key_of(obj: Json) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


@dataclass
class Reflector:
    client: KubeClient
    resource: Resource
    on_change: Callable[[], None]
    params: dict[str, str] = field(default_factory=dict)
    """Extra list/watch parameters, e.g. {"fieldSelector": "spec.nodeName=node-1"}."""
    items: dict[str, Json] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    async def _relist(self) -> str:
        listed = await self.client.list(self.resource, params=self.params)
        self.items = {key_of(o): o for o in listed.get("items") or []}
        self.synced.set()
        self.on_change()
        return str(listed["metadata"]["resourceVersion"])

    async def run(self) -> None:
        version = ""
        while True:
            try:
                if not version:
                    version = await self._relist()
                async for kind, obj in self.client.watch(self.resource, version, self.params):
                    version = obj["metadata"].get("resourceVersion", version)
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        self.items.pop(key_of(obj), None)
                    else:
                        self.items[key_of(obj)] = obj
                    self.on_change()
            except ApiError as exc:
                if exc.code == 410:
                    version = ""  # too old: list again
                    continue
                log.warning("watch %s: %s", self.resource.plural, exc.message)
                await asyncio.sleep(RETRY_S)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.info("watch %s ended: %s", self.resource.plural, exc)
                await asyncio.sleep(RETRY_S)
