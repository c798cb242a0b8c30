"""The fleet's discrete-event loop: pop the next event, move the clock, let it make new ones.

Events at the same instant are ordered by kind (a finishing step frees a replica before an
arrival is routed), then by insertion sequence, so a run is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

from kvfleet_gateway.fairness import with_room
from kvfleet_gateway.kv_events.hashing import page_hashes
from kvfleet_gateway.routing import Candidate, EventIndex, Policy, RouteRequest
from kvfleet_gateway.routing.blocks import BLOCK_TOKENS, token_blocks
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy
from kvfleet_operator.scaling.policy import shrink_order
from kvfleet_sim.engine import Engine, Step, VirtualClock
from kvfleet_sim.fleet.collector import Collector, RefusedRecord, RequestRecord
from kvfleet_sim.fleet.fair_gate import FleetGate
from kvfleet_sim.fleet.kv_events import FleetKvEvents
from kvfleet_sim.fleet.lora_fleet import FleetAdapters
from kvfleet_sim.fleet.model import (
    FleetConfig,
    FleetResult,
    FleetView,
    Progress,
    Replica,
    Scaler,
    Target,
)
from kvfleet_sim.fleet.routing import signals_of
from kvfleet_sim.fleet.workloads import Arrival, Workload
from kvfleet_sim.request import Request
from kvfleet_sim.scheduler import InputTooLongError, QueueFullError

STEP_END, READY, PROMOTED, SCRAPE, SCALE, ARRIVAL, PROGRESS, SUBMIT = range(8)


def _shrink(replicas: list[Replica]) -> list[int]:
    """The operator's order for taking replicas out of a role (`shrink_order`)."""
    return shrink_order([r.inflight_requests for r in replicas], [r.index for r in replicas])


class FleetSimulator:
    def __init__(self, config: FleetConfig, policy: Policy, scaler: Scaler | None = None) -> None:
        if config.replicas < 1 and scaler is None:
            raise ValueError("a fleet without a scaler needs at least one replica")
        self.config, self.policy, self.scaler = config, policy, scaler
        self.clock = VirtualClock()
        self.replicas: list[Replica] = []
        self.collector = Collector()
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._unrouted: list[Arrival] = []
        self._placed: dict[str, tuple[Arrival, RouteRequest, str, int]] = {}
        self._gateways: list[Policy] = []
        """Gateway replicas behind one Service (see `behind_gateways`); none: one gateway."""
        self._gw_inflight: list[dict[str, list[int]]] = []
        self._event_indexes: list[EventIndex] = []
        """Gateways' KV-event indexes every engine reports to (see `publish_kv_events`)."""
        self._next_gateway = 0
        self._outstanding = 0
        self._arrived = 0
        """Requests that arrived at the gateway so far (the gateways' requests counter)."""
        self._ttft_mark = 0
        """Records already reported to the scaler."""
        self._throughput: dict[int, float] = {}
        """Gateway → its latest estimate of a replica's throughput (its exported gauge)."""
        self._trace: list[tuple[float, int]] = []
        self._target = Target(config.replicas)
        self.roles_trace: list[tuple[float, int, int, int]] = []
        """(time, active, warm, starting) at every scaling tick and change."""
        self.gate: FleetGate | None = None
        """The gateway's overload queue (fairness on); None: every arrival goes at once."""
        self.adapters: FleetAdapters | None = None
        """LoRA: who holds which adapter, the gateway's choice for a request with one."""
        for _ in range(config.replicas):
            self._add_replica(0.0, ready_at=0.0)

    def behind_gateways(self, policies: list[Policy]) -> None:
        """Route through several gateway replicas, requests spread round robin over them (a
        Service in front of a gateway Deployment). Each has its own policy object — its own
        prefix index — and sees only its own in-flight requests, as separate gateway pods
        do; the engines' scraped metrics are the same for all."""
        self._gateways = list(policies)
        self._gw_inflight = [{} for _ in policies]

    def publish_kv_events(self, index: EventIndex) -> None:
        """Every engine, now and later, reports its cache's stores and evictions to `index`
        (a gateway with prefixIndex: events), and prompts are routed with their page hashes."""
        self._event_indexes.append(index)
        for rep in self.replicas:
            self._attach_events(rep)

    def _attach_events(self, rep: Replica) -> None:
        cache = rep.engine.scheduler.cache
        if self._event_indexes and self.config.engine.disable_radix_cache is False:
            cache.events = FleetKvEvents(
                rep.key, self.config.engine.page_size, list(self._event_indexes)
            )

    def _policy(self, gateway: int) -> Policy:
        return self._gateways[gateway] if self._gateways else self.policy

    def _report_work(self, gateway: int, rep: Replica, req: Request) -> None:
        """What a gateway does with a finished request's usage (`Proxy._report_work`): the
        kvfleet policy's request mix, and the throughput gauge for a replica like `rep`."""
        policy = self._policy(gateway)
        if not isinstance(policy, KvfleetPolicy):
            return
        policy.observe_work(req.prompt_len, req.cached_tokens, req.output_len)
        throughput = policy.throughput(rep.engine.load().max_total_num_tokens)
        if throughput is not None:
            self._throughput[gateway] = throughput

    def replica_throughput(self) -> float | None:
        """The gateways' throughput gauges, averaged (as the operator reads them)."""
        known = list(self._throughput.values())
        return sum(known) / len(known) if known else None

    # ---- plumbing -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    def _add_replica(self, now: float, ready_at: float) -> Replica:
        engine = Engine(self.config.engine, self.clock, profile=self.config.profile)
        rep = Replica(len(self.replicas), engine, created=now, ready_at=ready_at)
        self.replicas.append(rep)
        self._attach_events(rep)
        if ready_at > now:
            self._push(ready_at, READY, rep)
        return rep

    def _routable(self) -> list[Replica]:
        now = self.clock.t
        return [
            r
            for r in self.replicas
            if r.ready_at <= now and not r.draining and not r.warm and r.removed_at is None
        ]

    def _kick(self, rep: Replica) -> None:
        if rep.stepping:
            return
        step = rep.engine.begin_step()
        if step is None:
            if rep.draining and rep.inflight_requests == 0 and rep.removed_at is None:
                rep.removed_at = self.clock.t
                self._trace.append((self.clock.t, len(self._live())))
                self._record()
            return
        rep.stepping = True
        self._push(step.start + step.duration, STEP_END, (rep, step))

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.removed_at is None]

    # ---- events ---------------------------------------------------------------------------
    def engines(self) -> dict[str, Engine]:
        """Replica key → live engine (for the simulator-only oracle policy)."""
        return {r.key: r.engine for r in self._live()}

    def _route(self, arrival: Arrival) -> None:
        candidates = self._routable()
        if not candidates:
            self._unrouted.append(arrival)
            return
        now = self.clock.t
        ids = arrival.prompt_ids
        page = self.config.engine.page_size
        route = RouteRequest(
            self.config.engine.model.name,
            ids,
            token_blocks(ids),
            len(ids),
            arrival.max_new_tokens,
            BLOCK_TOKENS,
            pages=page_hashes(ids, page) if self._event_indexes else (),
            page_tokens=page,
        )
        gw = 0
        if self._gateways:
            gw = self._next_gateway % len(self._gateways)
            self._next_gateway += 1
        own = self._gw_inflight[gw] if self._gateways else None
        offered: list[Candidate] = []
        for r in candidates:
            # What this gateway knows: its own in-flight requests there.
            reqs, tokens = (
                own.get(r.key, (0, 0))
                if own is not None
                else (r.inflight_requests, r.inflight_tokens)
            )
            load = None if r.load is None else signals_of(r.load, now - r.scraped_at)
            offered.append(Candidate(r.key, reqs, tokens, load))
        if self.gate is not None:  # as the gateway's proxy does with fairness on
            offered = with_room(offered, self.gate.saturation)
        if self.adapters is not None and arrival.adapter is not None:
            offered = self.adapters.offer(arrival.adapter, offered)
        key = self._policy(gw).choose(route, offered)
        rep = next(r for r in candidates if r.key == key)
        n = next(self._rid)
        req = Request(
            rid=f"fleet-{n}",
            prompt_ids=ids,
            max_new_tokens=arrival.max_new_tokens,
            arrival_time=arrival.time,
            seed=n,
            adapter=arrival.adapter,
        )
        self._placed[req.rid] = (arrival, route, key, gw)
        delay = 0.0
        if self.adapters is not None and arrival.adapter is not None:
            delay = self.adapters.place(key, arrival.adapter)
        rep.inflight_requests += 1
        rep.inflight_tokens += req.prompt_len + req.max_new_tokens
        if own is not None:
            counts = own.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += req.prompt_len + req.max_new_tokens
        if delay > 0:  # the gateway loads the adapter there first, then sends the request
            self._push(now + delay, SUBMIT, (rep, req))
        else:
            self._submit(rep, req)

    def _submit(self, rep: Replica, req: Request) -> None:
        """Hand a request to its engine, which refuses what SGLang refuses (an input longer
        than the context or the KV pool: 400; a full queue: 503). A refusal is the client's
        answer, counted, and the request's in-flight bookkeeping is released."""
        try:
            rep.engine.submit(req)
        except (InputTooLongError, QueueFullError) as exc:
            arrival, route, key, gw = self._release(rep, req, 0)
            self._policy(gw).on_finished(route, key)
            status = 400 if isinstance(exc, InputTooLongError) else 503
            refused = RefusedRecord(
                req.arrival_time, req.prompt_len, status, str(exc), arrival.tenant
            )
            self.collector.refuse(refused)
        self._kick(rep)

    def _release(
        self, rep: Replica, req: Request, output_tokens: int
    ) -> tuple[Arrival, RouteRequest, str, int]:
        """A request is over (finished or refused): its in-flight bookkeeping is released."""
        arrival, route, key, gw = self._placed.pop(req.rid)
        if self._gateways:
            counts = self._gw_inflight[gw][key]
            counts[0] -= 1
            counts[1] -= req.prompt_len + req.max_new_tokens
        rep.inflight_requests -= 1
        rep.inflight_tokens -= req.prompt_len + req.max_new_tokens
        if self.adapters is not None and arrival.adapter is not None:
            self.adapters.ended(key, arrival.adapter)
        self._outstanding -= 1
        if self.gate is not None:
            self.gate.finished(arrival.tenant, output_tokens, self.clock.t)
        return arrival, route, key, gw

    def _candidates(self) -> list[Candidate]:
        """The routable replicas as the (one) gateway knows them."""
        now = self.clock.t
        return [
            Candidate(r.key, r.inflight_requests, r.inflight_tokens,
                      None if r.load is None else signals_of(r.load, now - r.scraped_at))
            for r in self._routable()
        ]  # fmt: skip

    def _admit(self, arrival: Arrival) -> None:
        if self.gate is None:
            self._route(arrival)
            return
        said = self.gate.arrive(arrival, self._candidates(), self.clock.t)
        if said == "go":
            self._route(arrival)
        elif said in ("shed", "displaced"):  # one request fewer to finish, either way
            self._outstanding -= 1

    def _release_gate(self) -> None:
        if self.gate is None or not len(self.gate.queue):
            return
        ready, timed_out = self.gate.ready(self._candidates(), self.clock.t)
        self._outstanding -= timed_out
        for arrival in ready:
            self._route(arrival)

    def _step_end(self, rep: Replica, step: Step, workload: Workload) -> None:
        rep.stepping = False
        rep.busy_s += step.duration
        outcome = rep.engine.end_step(step)
        for req in outcome.first_tokens:
            _, route, key, gw = self._placed[req.rid]
            self._policy(gw).on_first_token(route, key)
        for req in outcome.finished:
            arrival, route, key, gw = self._release(rep, req, req.output_len)
            assert req.first_token_time is not None
            assert req.finish_time is not None
            self.collector.add(
                RequestRecord(
                    arrival=req.arrival_time,
                    first_token=req.first_token_time,
                    finish=req.finish_time,
                    prompt_tokens=req.prompt_len,
                    output_tokens=req.output_len,
                    cached_tokens=req.cached_tokens,
                    replica=rep.index,
                    tenant=arrival.tenant,
                )
            )
            policy = self._policy(gw)
            itl = (
                (req.finish_time - req.first_token_time) / (req.output_len - 1)
                if req.output_len > 1
                else None
            )
            # Every simulated response is streamed: its first token is timed from dispatch.
            policy.observe(route, key, req.first_token_time - req.arrival_time, itl)
            self._report_work(gw, rep, req)
            policy.on_finished(route, key)
            if arrival.conversation is not None:
                out_ids = rep.engine.tokenizer.generate_ids(req.seed, req.output_len)
                nxt = workload.follow_up(arrival, out_ids, self.clock.t)
                if nxt is not None:
                    self._outstanding += 1
                    self._push(nxt.time, ARRIVAL, (nxt, False))
        self._release_gate()
        self._kick(rep)

    def _roles(self) -> tuple[list[Replica], list[Replica], list[Replica]]:
        """Live replicas by role: active (routable), warm (ready spares), starting."""
        now = self.clock.t
        live = self._live()
        warm = [r for r in live if r.ready_at <= now and r.warm and not r.draining]
        starting = [r for r in live if r.ready_at > now]
        return self._routable(), warm, starting

    def _record(self) -> None:
        active, warm, starting = self._roles()
        self.roles_trace.append((self.clock.t, len(active), len(warm), len(starting)))

    def _promote(self, rep: Replica) -> None:
        rep.promoting = True
        self._push(self.clock.t + self.config.promotion_s, PROMOTED, rep)

    def _on_promoted(self, rep: Replica) -> None:
        rep.promoting = False
        if rep.removed_at is not None or rep.draining or not rep.warm:
            return
        rep.warm, rep.active_since = False, self.clock.t
        self._record()
        self._route_held()

    def _route_held(self) -> None:
        if self._routable():
            pending, self._unrouted = self._unrouted, []
            for arrival in pending:
                self._route(arrival)

    def _apply_roles(self) -> None:
        """Promote warm spares up to the target's active count (as the operator does on
        every tick and whenever a pod becomes ready)."""
        now = self.clock.t
        live = [r for r in self._live() if r.ready_at <= now and not r.draining]
        active = [r for r in live if not r.warm]
        promoting = [r for r in live if r.warm and r.promoting]
        spares = sorted((r for r in live if r.warm and not r.promoting), key=lambda r: r.index)
        for rep in spares[: max(0, self._target.active - len(active) - len(promoting))]:
            self._promote(rep)

    def _scale(self) -> None:
        assert self.scaler is not None
        now = self.clock.t
        active, warm, starting = self._roles()
        interval = self.config.scale_interval_s
        view = FleetView(
            now,
            [r.view() for r in active],
            frozenset(r.index for r in active if now - r.active_since < 60.0),
            [min(1.0, (r.busy_s - r.busy_mark) / interval) for r in active],
            len(warm),
            len(starting),
            len(self._unrouted),
            self._arrived,
            tuple(r.ttft for r in self.collector.records[self._ttft_mark :]),
            self.replica_throughput(),
        )
        self._ttft_mark = len(self.collector.records)
        for r in self._live():
            r.busy_mark = r.busy_s
        target = self._target = self.scaler.target(view)
        # Demote: the least busy active replicas stop taking requests; in flight ones finish.
        for i in _shrink(active)[: max(0, len(active) - target.active)]:
            active[i].warm = True
        self._apply_roles()
        have = len(active) + len(warm) + len(starting)
        want = target.active + target.warm
        for _ in range(max(0, want - have)):
            self._add_replica(now, ready_at=now + self.config.cold_start_s)
        surplus = have - want
        # Remove what goes without losing work: starting pods first, then idle spares, then
        # spares still finishing requests (they leave when idle).
        for rep in sorted(starting, key=lambda r: -r.created)[: max(0, surplus)]:
            rep.removed_at, surplus = now, surplus - 1
        spares = [r for r in self._live() if r.ready_at <= now and r.warm and not r.promoting]
        for i in _shrink(spares)[: max(0, surplus)]:
            spares[i].draining = True
            self._kick(spares[i])
        self._trace.append((now, len(self._live())))
        self._record()

    # ---- run ------------------------------------------------------------------------------
    def run(
        self,
        workload: Workload,
        on_progress: Callable[[Progress], None] | None = None,
        progress_interval_s: float = 1.0,
        time_limit_s: float = math.inf,
    ) -> FleetResult:
        arrivals: Iterator[Arrival] = iter(workload)
        first = next(arrivals, None)
        if first is None:
            raise ValueError("the workload produced no requests")
        self._outstanding = 1
        self._push(first.time, ARRIVAL, (first, True))
        self._push(0.0, SCRAPE)
        if self.scaler is not None:
            self._push(self.config.scale_interval_s, SCALE)
        if on_progress is not None:
            self._push(progress_interval_s, PROGRESS)
        self._trace.append((0.0, len(self._live())))
        self._record()
        last_work = 0.0
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            if t > time_limit_s:
                break
            self.clock.t = t
            periodic_alive = self._outstanding > 0
            if kind in (STEP_END, ARRIVAL, READY, SUBMIT):
                last_work = t
            if kind == STEP_END:
                self._step_end(payload[0], payload[1], workload)
            elif kind == ARRIVAL:
                self._arrived += 1
                arrival, from_source = payload
                if from_source:  # keep exactly one pending arrival from the (lazy) source
                    nxt = next(arrivals, None)
                    if nxt is not None:
                        self._outstanding += 1
                        self._push(nxt.time, ARRIVAL, (nxt, True))
                self._admit(arrival)
            elif kind == READY:
                rep = payload
                if rep.removed_at is None:
                    if self.config.warm_start:
                        rep.warm = True  # the operator admits it (promotes) when needed
                        self._apply_roles()
                    else:
                        rep.active_since = t
                self._trace.append((t, len(self._live())))
                self._record()
                self._route_held()
            elif kind == PROMOTED:
                self._on_promoted(payload)
            elif kind == SUBMIT:
                rep, req = payload
                self._submit(rep, req)
            elif kind == SCRAPE and periodic_alive:
                for rep in self._live():
                    rep.load, rep.scraped_at = rep.engine.load(), t
                self._release_gate()
                self._push(t + self.config.scrape_interval_s, SCRAPE)
            elif kind == SCALE and periodic_alive:
                self._scale()
                self._push(t + self.config.scale_interval_s, SCALE)
            elif kind == PROGRESS and periodic_alive and on_progress is not None:
                on_progress(
                    Progress(t, len(self.collector.records), self.collector.records, self.replicas)
                )
                self._push(t + progress_interval_s, PROGRESS)
        end = last_work  # bill until the work ends, not until the last periodic tick
        gpus = self.config.engine.tp_size
        gpu_seconds = sum(
            ((r.removed_at if r.removed_at is not None else end) - r.created) * gpus
            for r in self.replicas
        )
        busy = [r.busy_s for r in self.replicas]
        retractions = sum(r.engine.scheduler.retracted_total for r in self.replicas)
        return FleetResult(
            summary=self.collector.summary(busy, gpu_seconds, retractions),
            records=self.collector.records,
            replica_busy_s=busy,
            refused=self.collector.refused,
            replica_count_trace=self._trace,
            roles_trace=self.roles_trace,
        )
