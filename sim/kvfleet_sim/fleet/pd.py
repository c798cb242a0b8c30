"""A disaggregated fleet in simulated time: prefill engines, decode engines, and the
gateway's pairing of them — the same policies the product's gateway runs.

Each arrival is routed as the gateway routes it: the prefill engine by the configured
policy (prefix hits live there), the decode engine by least load, both chosen at arrival.
The prefill engine computes the prompt and one token; the KV then crosses the link (its
bytes over the link's per-GPU bandwidth, each GPU of the prefill engine sending its shard);
the decode engine admits the request once the KV has arrived and fits (no prefill compute)
and streams the rest. Records time the first token as the client sees it: the decode
engine's, counted from the arrival.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvfleet_gateway.routing import Candidate, Policy, RouteRequest
from kvfleet_gateway.routing.blocks import BLOCK_TOKENS, token_blocks
from kvfleet_sim.catalog import BUILTIN, LinkSpec
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.costmodel import DEFAULT_PROFILE
from kvfleet_sim.disaggregation import DEFAULT_LINK, transfer_seconds
from kvfleet_sim.engine import Engine, EngineLoad, Step, VirtualClock
from kvfleet_sim.fleet.collector import RequestRecord
from kvfleet_sim.fleet.routing import signals_of
from kvfleet_sim.fleet.workloads import Arrival
from kvfleet_sim.request import Request

STEP_END, HANDOFF, SCRAPE, ARRIVAL = range(4)


@dataclass(frozen=True)
class PdFleetConfig:
    prefill: EngineConfig
    decode: EngineConfig
    """The decode engines' config (the prefix cache is switched off, as SGLang's decode
    servers run by default)."""
    prefill_replicas: int
    decode_replicas: int
    link: LinkSpec = field(default_factory=lambda: BUILTIN.link(DEFAULT_LINK))
    """The catalogue link the KV crosses from a prefill engine to a decode engine."""
    profile: str = DEFAULT_PROFILE
    scrape_interval_s: float = 1.0


@dataclass(eq=False)
class _Node:
    key: str
    engine: Engine
    stepping: bool = False
    inflight_requests: int = 0
    inflight_tokens: int = 0
    load: EngineLoad | None = None
    scraped_at: float = 0.0
    busy_s: float = 0.0

    def candidate(self, now: float) -> Candidate:
        signals = None if self.load is None else signals_of(self.load, now - self.scraped_at)
        return Candidate(self.key, self.inflight_requests, self.inflight_tokens, signals)


@dataclass
class _Flight:
    arrival: Arrival
    route: RouteRequest
    prefill: _Node
    decode: _Node


@dataclass
class PdResult:
    records: list[RequestRecord]
    transfer_s: list[float]
    """Each request's KV transfer time."""
    prefill_busy_s: list[float] = field(default_factory=list)
    decode_busy_s: list[float] = field(default_factory=list)


class PdFleet:
    def __init__(self, config: PdFleetConfig, prefill_policy: Policy, decode_policy: Policy):
        self.config = config
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.clock = VirtualClock()
        decode_cfg = dataclasses.replace(config.decode, disable_radix_cache=True)
        self.prefills = [
            _Node(f"prefill-{i}", Engine(config.prefill, self.clock, profile=config.profile))
            for i in range(config.prefill_replicas)
        ]
        self.decodes = [
            _Node(f"decode-{i}", Engine(decode_cfg, self.clock, profile=config.profile))
            for i in range(config.decode_replicas)
        ]
        self._kv_per_token = derive_layout(config.prefill).kv_bytes_per_token_per_gpu
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._flights: dict[str, _Flight] = {}
        self._records: list[RequestRecord] = []
        self._transfers: list[float] = []

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    def _kick(self, node: _Node) -> None:
        if node.stepping:
            return
        step = node.engine.begin_step()
        if step is not None:
            node.stepping = True
            self._push(step.start + step.duration, STEP_END, (node, step))

    def _route(self, arrival: Arrival) -> None:
        now = self.clock.t
        ids = arrival.prompt_ids
        route = RouteRequest(self.config.prefill.model.name, ids, token_blocks(ids), len(ids),
                             arrival.max_new_tokens, BLOCK_TOKENS)  # fmt: skip
        p_key = self.prefill_policy.choose(route, [n.candidate(now) for n in self.prefills])
        d_key = self.decode_policy.choose(route, [n.candidate(now) for n in self.decodes])
        prefill = next(n for n in self.prefills if n.key == p_key)
        decode = next(n for n in self.decodes if n.key == d_key)
        n = next(self._rid)
        rid = f"pd-{n}"
        self._flights[rid] = _Flight(arrival, route, prefill, decode)
        tokens = len(ids) + arrival.max_new_tokens
        for node in (prefill, decode):  # both halves are in flight from the start
            node.inflight_requests += 1
            node.inflight_tokens += tokens
        prefill.engine.submit(Request(rid, ids, 1, arrival.time, seed=n))
        self._kick(prefill)

    def _step_end(self, node: _Node, step: Step) -> None:
        node.stepping = False
        node.busy_s += step.duration
        outcome = node.engine.end_step(step)
        is_prefill = node in self.prefills
        for req in outcome.finished:
            flight = self._flights[req.rid]
            if is_prefill:
                self._prefilled(flight, req)
            else:
                self._decoded(flight, req)
        self._kick(node)

    def _prefilled(self, flight: _Flight, req: Request) -> None:
        node = flight.prefill
        node.inflight_requests -= 1
        node.inflight_tokens -= req.prompt_len + flight.arrival.max_new_tokens
        self.prefill_policy.on_first_token(flight.route, node.key)
        self.prefill_policy.on_finished(flight.route, node.key)
        seconds = transfer_seconds(req.prompt_len, self._kv_per_token, self.config.link)
        self._transfers.append(seconds)
        handed = Request(req.rid, req.prompt_ids, flight.arrival.max_new_tokens,
                         flight.arrival.time, seed=req.seed)  # fmt: skip
        handed.prefilled, handed.cached_tokens = True, req.cached_tokens
        self._push(self.clock.t + seconds, HANDOFF, (flight.decode, handed))

    def _decoded(self, flight: _Flight, req: Request) -> None:
        node = flight.decode
        node.inflight_requests -= 1
        node.inflight_tokens -= req.prompt_len + req.max_new_tokens
        self.decode_policy.on_finished(flight.route, node.key)
        del self._flights[req.rid]
        assert req.first_token_time is not None and req.finish_time is not None
        self._records.append(
            RequestRecord(
                arrival=flight.arrival.time,
                first_token=req.first_token_time,
                finish=req.finish_time,
                prompt_tokens=req.prompt_len,
                output_tokens=req.output_len,
                cached_tokens=req.cached_tokens,
                replica=int(node.key.rsplit("-", 1)[1]),
                tenant=flight.arrival.tenant,
            )
        )

    def run(self, arrivals: Iterable[Arrival]) -> PdResult:
        for a in arrivals:
            self._push(a.time, ARRIVAL, a)
        self._push(0.0, SCRAPE, None)
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            self.clock.t = t
            if kind == STEP_END:
                self._step_end(*payload)
            elif kind == HANDOFF:
                node, req = payload
                node.engine.submit(req)
                self._kick(node)
            elif kind == ARRIVAL:
                self._route(payload)
            elif kind == SCRAPE and self._events:  # while anything else is still to happen
                for node in (*self.prefills, *self.decodes):
                    node.load, node.scraped_at = node.engine.load(), t
                self._push(t + self.config.scrape_interval_s, SCRAPE, None)
        return PdResult(
            self._records,
            self._transfers,
            [n.busy_s for n in self.prefills],
            [n.busy_s for n in self.decodes],
        )
