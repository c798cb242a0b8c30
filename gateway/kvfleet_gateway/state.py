"""What one gateway process holds: its config, keys, limits store, backends, metrics and the
pieces of routing, shared by the handlers through one typed app key."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from kvfleet_gateway.backends import BackendPool
from kvfleet_gateway.config import GatewayConfig
from kvfleet_gateway.fair_gate import FairGate
from kvfleet_gateway.keys import KeyWatcher, Tenant
from kvfleet_gateway.kv_events.prompts import PromptTokenizer
from kvfleet_gateway.limiter import LimitStore
from kvfleet_gateway.lora import AdapterManager
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.pre_admission import PreAdmission
from kvfleet_gateway.proxy import Proxy
from kvfleet_gateway.routing import EventIndex

ANONYMOUS = Tenant("anonymous", None)


@dataclass
class Gateway:
    config: GatewayConfig
    keys: KeyWatcher | None
    store: LimitStore
    pool: BackendPool
    metrics: GatewayMetrics
    fair: FairGate
    """The overload queue (fairness)."""
    lora: AdapterManager
    """LoRA adapters: which model a request names, where its adapter is."""
    proxy: Proxy | None = None
    events: EventIndex | None = None
    """Exact prefix state from the engines' KV events (prefixIndex.source: events)."""
    prompts: PromptTokenizer | None = None
    pre: PreAdmission = field(default_factory=lambda: PreAdmission(1.0, 1.0))
    """What is decided before a body is read (make_app sizes it from the config)."""


GATEWAY = web.AppKey("kvfleet_gateway", Gateway)
