"""The gateway's overload queue in simulated time: the product's `FairQueue` and `room`
(kvfleet_gateway.fairness), with arrivals where the gateway has waiting HTTP requests, so
`kvfleet bench fairness` measures the order the gateway runs.

What differs from the gateway is only the plumbing: an arrival that may go is routed at
once; one that must wait is queued (a sheddable one, or one over `max_waiting`, is shed);
the fleet asks `ready` for what may go whenever a request ends or the engines are scraped,
dropping those whose deadline passed (shed as `timeout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvfleet_gateway.fairness import (
    FairQueue,
    Priority,
    Saturation,
    ServiceWeights,
    goes_now,
)
from kvfleet_gateway.routing import Candidate
from kvfleet_sim.fleet.workloads import Arrival

Admission = Literal["go", "wait", "shed", "displaced"]
"""The arrival goes now, waits, is shed, or waits having displaced a queued request (which
the caller counts as shed)."""


@dataclass(frozen=True)
class TenantShare:
    weight: float = 1.0
    priority: Priority = "standard"


@dataclass
class Shed:
    arrival: Arrival
    at: float
    reason: str


@dataclass
class FleetGate:
    saturation: Saturation
    max_waiting: int = 1000
    timeout_s: float = 60.0
    tenants: Mapping[str, TenantShare] = field(default_factory=dict)
    weights: ServiceWeights = field(default_factory=ServiceWeights)
    running: int = 0
    shed: list[Shed] = field(default_factory=list)
    queue: FairQueue[Arrival] = field(init=False)
    waits: list[tuple[float, str, float]] = field(default_factory=list)
    """(arrival time, tenant, seconds waited at the gate) of every request let through."""
    service: list[tuple[float, str, float]] = field(default_factory=list)
    """(time, tenant, weighted tokens) of every charge: each tenant's service over time."""
    _since: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.queue = FairQueue(self.max_waiting, self.weights)

    def _share(self, tenant: str) -> TenantShare:
        return self.tenants.get(tenant, TenantShare())

    def arrive(self, arrival: Arrival, candidates: Sequence[Candidate], now: float) -> Admission:
        share = self._share(arrival.tenant)
        if goes_now(self.queue, arrival.tenant, self.running, candidates, self.saturation):
            self._start(arrival, now)
            return "go"
        if share.priority == "sheddable":
            self.shed.append(Shed(arrival, now, "sheddable"))
            return "shed"
        displaced = self.queue.push(arrival, arrival.tenant, share.priority)
        for other in displaced:
            if other is arrival:
                self.shed.append(Shed(arrival, now, "queue_full"))
                return "shed"
            self._since.pop(id(other))
            self.shed.append(Shed(other, now, "displaced"))
        self._since[id(arrival)] = now
        return "displaced" if displaced else "wait"

    def ready(self, candidates: Sequence[Candidate], now: float) -> tuple[list[Arrival], int]:
        """Arrivals that may go now, and how many waiting ones were shed for their deadline."""
        out: list[Arrival] = []
        timed_out = 0
        while self.queue.releasable(self.running, candidates, self.saturation):
            popped = self.queue.pop()
            assert popped is not None
            arrival = popped[0]
            if now - self._since.pop(id(arrival)) > self.timeout_s:
                self.shed.append(Shed(arrival, now, "timeout"))
                timed_out += 1
                continue
            self._start(arrival, now)
            out.append(arrival)
        return out, timed_out

    def finished(self, tenant: str, output_tokens: int, now: float) -> None:
        self.running -= 1
        self._charge(tenant, now, output_tokens=output_tokens)

    def _start(self, arrival: Arrival, now: float) -> None:
        self.waits.append((arrival.time, arrival.tenant, now - arrival.time))
        self.running += 1
        self._charge(arrival.tenant, now, prompt_tokens=len(arrival.prompt_ids))

    def _charge(self, tenant: str, now: float, prompt_tokens: int = 0,
                output_tokens: int = 0) -> None:  # fmt: skip
        self.queue.charge(tenant, self._share(tenant).weight, prompt_tokens, output_tokens)
        w = self.weights
        self.service.append(
            (now, tenant, prompt_tokens * w.prompt_weight + output_tokens * w.output_weight)
        )
