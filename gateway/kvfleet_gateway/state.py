"""What one gateway process holds: its config, keys, limits store, backends, metrics and the
pieces of routing, shared by the handlers through one typed app key."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from kvfleet_gateway.config import GatewayConfig
from kvfleet_gateway.keys import KeyWatcher, Tenant
from kvfleet_gateway.limiter import LimitStore
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.pools import PoolSet
from kvfleet_gateway.pre_admission import PreAdmission

ANONYMOUS = Tenant("anonymous", None)


@dataclass
class Gateway:
    config: GatewayConfig
    keys: KeyWatcher | None
    store: LimitStore
    pools: PoolSet
    """The engines behind this gateway, one pool per service, and which serves which model."""
    metrics: GatewayMetrics
    pre: PreAdmission = field(default_factory=lambda: PreAdmission(1.0, 1.0))
    """What is decided before a body is read (make_app sizes it from the config)."""


GATEWAY = web.AppKey("kvfleet_gateway", Gateway)
