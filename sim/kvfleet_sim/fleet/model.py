"""The fleet simulator's data: its configuration, a replica's state, what a Scaler sees and
answers, and what a run returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet_sim.config import EngineConfig
from kvfleet_sim.costmodel import DEFAULT_PROFILE
from kvfleet_sim.engine import Engine, EngineLoad
from kvfleet_sim.fleet.collector import FleetSummary, RefusedRecord, RequestRecord
from kvfleet_sim.fleet.routing import ReplicaView


@dataclass(frozen=True)
class FleetConfig:
    engine: EngineConfig
    replicas: int = 8
    """Replicas ready at t=0."""
    profile: str = DEFAULT_PROFILE
    scrape_interval_s: float = 1.0
    """How often the router's view of engine metrics refreshes (a gateway scrapes /metrics)."""
    cold_start_s: float = 120.0
    """Time from a scale-up decision to a ready replica (pod start + model load)."""
    scale_interval_s: float = 15.0
    """How often the Scaler is asked for a replica count."""
    promotion_s: float = 5.0
    """Time from relabelling a warm replica active to its first routed request (the
    operator's patch, the gateway's watch)."""
    warm_start: bool = False
    """New replicas start warm (kvfleet's operator admits them); False: they take traffic as
    soon as they are ready (a plain Deployment behind a Service)."""


@dataclass(frozen=True)
class FleetView:
    """What a Scaler sees at a tick."""

    now: float
    active: Sequence[ReplicaView]
    """Replicas taking traffic (ready, active, not draining)."""
    young: frozenset[int]
    """Indexes of active replicas that became active in the last minute."""
    busy: Sequence[float]
    """Share of the last interval each active replica spent computing (GPU utilization)."""
    warm: int
    """Ready spares (no traffic), promotions under way included."""
    starting: int
    """Replicas created and not ready yet."""
    held: int
    """Requests waiting because no replica is active."""
    arrived: int = 0
    """Requests that arrived so far (a counter, as the gateways' requests_total)."""
    recent_ttfts: tuple[float, ...] = ()
    """TTFTs of the requests that finished since the last tick."""
    replica_throughput: float | None = None
    """The gateways' estimate of what one replica completes per second at most (None: not
    yet; a kvfleet-routed fleet only)."""


@dataclass(frozen=True)
class Target:
    active: int
    warm: int = 0


class Scaler(Protocol):
    def target(self, view: FleetView) -> Target:
        """How many active replicas and warm spares the fleet should have now."""
        ...


@dataclass(eq=False)
class Replica:
    index: int
    engine: Engine
    created: float
    ready_at: float
    removed_at: float | None = None
    draining: bool = False
    warm: bool = False
    """Ready and loaded, taking no new requests (a spare, or demoted and finishing)."""
    promoting: bool = False
    active_since: float = 0.0
    busy_mark: float = 0.0
    stepping: bool = False
    inflight_requests: int = 0
    inflight_tokens: int = 0
    busy_s: float = 0.0
    load: EngineLoad | None = None
    scraped_at: float = 0.0

    @property
    def key(self) -> str:
        return f"replica-{self.index}"

    def view(self) -> ReplicaView:
        load = self.load or self.engine.load()
        return ReplicaView(
            self.index,
            f"replica-{self.index}",
            load,
            self.scraped_at,
            self.inflight_requests,
            self.inflight_tokens,
        )


@dataclass(frozen=True)
class Progress:
    now: float
    finished: int
    records: list[RequestRecord]
    replicas: list[Replica]


@dataclass(frozen=True)
class FleetResult:
    summary: FleetSummary
    records: list[RequestRecord]
    replica_busy_s: list[float]
    refused: list[RefusedRecord] = field(default_factory=list)
    """Requests the engines refused at submission (see `FleetSummary.refused`)."""
    replica_count_trace: list[tuple[float, int]] = field(default_factory=list)
    roles_trace: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(time, active, warm, starting) whenever the fleet changed."""
