"""kopf wiring: watch InferenceServices and their children, reconcile through a work queue.

kopf watches the InferenceServices with a watching handler only (`@kopf.on.event`), so it
never writes to them (no finalizers, no progress annotations): an operator restart costs
reads, not writes. The children are watched by the operator's own informers (`informer.py`),
which ask the API server to filter by the operator's labels — kopf's label filters run in
the client, after every pod of the cluster has been sent. Every event — of an
InferenceService or of one of its children — queues that InferenceService; a single worker
reconciles queued keys one at a time (a key queued twice while waiting is reconciled once),
retries failures with backoff, and resyncs every known object periodically so drift is
repaired even if an event is missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web
from kubernetes.client.exceptions import ApiException

from kvfleet_kernel.schema import Json
from kvfleet_operator.cache import WatchCache
from kvfleet_operator.gateway_spec import IG_PLURAL, KVFLEET_IMAGE
from kvfleet_operator.informer import Informer
from kvfleet_operator.kube import IGW, ISVC, Kube, resource_by_plural
from kvfleet_operator.liveness import Progress, stalled
from kvfleet_operator.login import Credentials, kopf_login
from kvfleet_operator.metrics import OperatorMetrics
from kvfleet_operator.policy import Policy
from kvfleet_operator.reconcile import Outcome, ReconcileOptions, reconcile
from kvfleet_operator.reconcile_gateway import reconcile_gateway
from kvfleet_operator.render.common import (
    DEFAULT_OPERATOR_NAMESPACE,
    IG_LABEL,
    ISVC_LABEL,
    MANAGED_BY,
)
from kvfleet_operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, Scaled
from kvfleet_operator.spec import GROUP, PLURAL, VERSION

log = logging.getLogger("kvfleet.operator")

GATEWAY_KEY = "inferencegateway/"
"""Queue keys of InferenceGateways: `(namespace, "inferencegateway/<name>")` (an
InferenceService's name holds no slash, so the two never meet)."""

CHILD_KINDS = [
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "secrets"),
    ("", "v1", "serviceaccounts"),
    ("", "v1", "pods"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("", "v1", "persistentvolumeclaims"),
]
"""Children whose edits or deletion bring the owner back to its reconcile (and whose
objects the watch cache holds)."""
MONITORING_KINDS = [("monitoring.coreos.com", "v1", "podmonitors")]
"""Watched only when the API server serves them (the Prometheus Operator is installed)."""
LWS_KINDS = [("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")]
"""Watched only when LeaderWorkerSet is installed (multi-node replicas need it)."""


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty: the whole cluster."""
    resync_s: float = 60.0
    """Every known InferenceService is reconciled at least this often."""
    max_backoff_s: float = 60.0
    """Longest wait before retrying a reconcile that failed."""
    liveness_endpoint: str | None = None
    """kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz (None: none)."""
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    """Where the operator runs (the downward API's metadata.namespace in its manifests)."""
    gateway_image: str = KVFLEET_IMAGE
    """The operator's own image (its manifests set $KVFLEET_IMAGE from the image they run it
    with): the gateways it renders run it unless a spec names another."""
    stall_s: float = 300.0
    """The liveness probe fails when work is pending and no reconcile has succeeded for this
    long, or no autoscaler tick has completed for this long (`liveness.py`)."""
    credentials: Credentials = field(default_factory=Credentials)
    """How both the client and kopf's watches log in (in-cluster, kubeconfig)."""
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    """Where the autoscaler reads its signals, and how often it decides."""
    policy: Policy = field(default_factory=Policy)
    """What an InferenceService may set: images, tolerations, priority classes, exposure."""
    metrics_port: int | None = None
    """Serve the operator's Prometheus metrics on this port (`kvfleet operator` default:
    8081); None: not served."""


@dataclass
class Controller:
    """The work queue between kopf's watch events and `reconcile`."""

    kube: Kube
    config: OperatorConfig
    options: ReconcileOptions = field(default_factory=ReconcileOptions)
    on_outcome: Callable[[str, Outcome], None] | None = None
    reconciler: Callable[[str, str], Awaitable[Outcome]] | None = None
    """Test seam: reconcile one key; None runs `reconcile` in a worker thread."""
    known: set[tuple[str, str]] = field(default_factory=set)
    gateways: set[tuple[str, str]] = field(default_factory=set)
    """InferenceGateways watched, as queue keys."""
    bodies: dict[tuple[str, str], Json] = field(default_factory=dict)
    """The latest InferenceService of each key, as watched (the autoscaler reads specs here)."""
    autoscaler: Autoscaler | None = None
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    informers: list[tuple[Informer, threading.Thread]] = field(default_factory=list)
    """The child kinds' list-watches (`informer.py`), started with the operator."""
    _queued: set[tuple[str, str]] = field(default_factory=set)
    _queue: asyncio.Queue[tuple[str, str]] = field(default_factory=asyncio.Queue)
    _failures: dict[tuple[str, str], int] = field(default_factory=dict)
    _busy: bool = False
    _worker_ok_at: float = field(default_factory=time.monotonic)
    _tick_done_at: float = field(default_factory=time.monotonic)

    def progress(self) -> Progress:
        autoscaled = any((b.get("spec") or {}).get("autoscaling") for b in self.bodies.values())
        return Progress(
            now=time.monotonic(),
            worker_pending=self._busy or bool(self._queued) or bool(self._failures),
            worker_ok_at=self._worker_ok_at,
            autoscaling=autoscaled,
            tick_done_at=self._tick_done_at,
        )

    def enqueue(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)
            self.metrics.queue_depth.set(self._queue.qsize())

    def __post_init__(self) -> None:
        if self.autoscaler is None:
            self.autoscaler = Autoscaler(self.kube, self.config.autoscaler)
        self.autoscaler.on_decision = self._record_decision
        self.metrics.watch_kube(
            lambda: dict(self.kube.calls),
            lambda: self.kube.cache.hits if self.kube.cache is not None else 0,
        )

    async def start_informers(self, kinds: list[tuple[str, str, str]]) -> None:
        """One informer per child kind (and watched namespace), each listed before the
        worker starts so the first reconciles read a full cache; then one watch thread each."""
        assert self.kube.cache is not None
        cache, loop = self.kube.cache, asyncio.get_running_loop()
        for ns in self.config.namespaces or (None,):  # the InferenceServices: kopf watches them
            # From the API server each time (`kube.list` answers from the cache once the
            # kind is primed, which the first namespace's listing does).
            for res in (ISVC, IGW):
                try:
                    listed = await asyncio.to_thread(self.kube.request, "GET", res.path(ns))
                except ApiException as exc:
                    if exc.status != 404 or res is ISVC:  # an older CRD set: no gateways
                        raise
                    listed = {}
                cache.replace(res.plural, ns, listed.get("items") or [])

        def changed(obj: Json) -> None:  # on an informer's thread
            meta = obj.get("metadata") or {}
            labels, ns = meta.get("labels") or {}, meta.get("namespace")
            owner = labels.get(ISVC_LABEL)
            if labels.get(IG_LABEL):
                owner = GATEWAY_KEY + labels[IG_LABEL]
            if owner and ns:
                loop.call_soon_threadsafe(self.child_changed, ns, owner)

        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        for _, _, plural in kinds:
            for ns in self.config.namespaces or (None,):
                informer = Informer(
                    self.kube, resource_by_plural(plural), ns, selector, cache, changed
                )
                rv = await asyncio.to_thread(informer.relist)
                thread = threading.Thread(
                    target=informer.run, args=(rv,), name=f"watch-{plural}", daemon=True
                )
                thread.start()
                self.informers.append((informer, thread))

    def stop_informers(self) -> None:
        for informer, _ in self.informers:
            informer.stop()
        for _, thread in self.informers:
            thread.join(timeout=5)
        self.informers.clear()

    def child_changed(self, namespace: str, owner: str) -> None:
        if (namespace, owner) in self.known or (namespace, owner) in self.gateways:
            self.enqueue(namespace, owner)
        spec = (self.bodies.get((namespace, owner)) or {}).get("spec") or {}
        if (spec.get("gateway") or {}).get("inferenceGateway"):
            self.service_changed(namespace)  # its engines' key may have just been created

    def service_changed(self, namespace: str) -> None:
        """A service joined, changed or left: its namespace's gateways render their pools
        again (a few per namespace; each writes only what differs)."""
        for ns, key in sorted(self.gateways):
            if ns == namespace:
                self.enqueue(ns, key)

    def forget(self, namespace: str, name: str) -> None:
        self.known.discard((namespace, name))
        self.bodies.pop((namespace, name), None)
        self._failures.pop((namespace, name), None)
        self.metrics.services.set(len(self.known))

    def _reconcile_sync(self, namespace: str, name: str) -> Outcome:
        # One worker: reconciles never overlap, for one object or across objects.
        if name.startswith(GATEWAY_KEY):
            return reconcile_gateway(self.kube, namespace, name[len(GATEWAY_KEY) :], self.options)
        a = self.autoscaler
        scaled = a.latest.get((namespace, name)) if a else None
        prefill = a.prefill_latest.get((namespace, name)) if a else None
        return reconcile(self.kube, namespace, name, self.options, scaled, prefill)

    async def _retry_later(self, key: tuple[str, str], delay: float) -> None:
        await asyncio.sleep(delay)
        self.enqueue(*key)

    async def work(self) -> None:
        retries: set[asyncio.Task[None]] = set()
        try:
            while True:
                if not self._queued and not self._failures:
                    self._worker_ok_at = time.monotonic()  # idle with nothing pending
                key = await self._queue.get()
                self._busy = True
                self._queued.discard(key)
                self.metrics.queue_depth.set(self._queue.qsize())
                started = time.perf_counter()
                try:
                    if self.reconciler is not None:
                        outcome = await self.reconciler(*key)
                    else:
                        outcome = await asyncio.to_thread(self._reconcile_sync, *key)
                except Exception as exc:
                    self._busy = False
                    self.metrics.reconciles.labels("error").inc()
                    n = self._failures.get(key, 0) + 1
                    self._failures[key] = n
                    delay = min(self.config.max_backoff_s, 0.5 * 2**n)
                    log.warning("reconcile %s/%s failed (%s); retry in %.1fs", *key, exc, delay)
                    task = asyncio.create_task(self._retry_later(key, delay))
                    retries.add(task)
                    task.add_done_callback(retries.discard)
                    continue
                self._busy = False
                self._worker_ok_at = time.monotonic()
                self.metrics.reconciles.labels("ok").inc()
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
                self._failures.pop(key, None)
                if outcome.created or outcome.patched or outcome.relabelled:
                    log.info(
                        "%s/%s: created %s, repaired %s, roles %s",
                        *key,
                        outcome.created,
                        outcome.patched,
                        outcome.relabelled,
                    )
                if self.on_outcome is not None:
                    self.on_outcome(f"{key[0]}/{key[1]}", outcome)
        finally:
            for task in retries:
                task.cancel()

    async def resync(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync_s)
            for key in sorted(self.known | self.gateways):
                self.enqueue(*key)

    async def autoscale(self) -> None:
        """Decide for every autoscaled service each interval; reconcile those that moved."""
        assert self.autoscaler is not None
        while True:
            await asyncio.sleep(self.config.autoscaler.interval_s)
            bodies = {k: b for k, b in self.bodies.items() if k in self.known}
            try:
                changed = await self.autoscaler.tick(bodies)
            except Exception as exc:  # a bad tick must not stop the operator
                log.warning("autoscaler tick failed: %s", exc)
                continue
            finally:
                self._tick_done_at = time.monotonic()
            for key in changed:
                self.enqueue(*key)

    def _record_decision(self, key: tuple[str, str], old: Scaled | None, new: Scaled) -> None:
        d = new.decision
        self.metrics.desired.labels(*key, "active").set(d.desired_active)
        self.metrics.desired.labels(*key, "warm").set(d.desired_warm)
        if old is None:
            return
        was, now = old.decision.desired_active, d.desired_active
        if (was, old.decision.desired_warm) == (now, d.desired_warm):
            return
        direction = "up" if now > was else "down" if now < was else "warm"
        self.metrics.scaling_decisions.labels(*key, direction).inc()


def make_registry(
    controller: Controller, pod_monitors: bool, leader_worker_sets: bool = False
) -> kopf.OperatorRegistry:
    """kopf's handlers; `pod_monitors`: the API server serves monitoring.coreos.com/v1 (only
    then are PodMonitors rendered, and watched); `leader_worker_sets`: it serves
    leaderworkerset.x-k8s.io/v1 (only then are multi-node services rendered, and watched)."""
    registry = kopf.OperatorRegistry()
    tasks: list[asyncio.Task[None]] = []
    runners: list[web.AppRunner] = []

    @kopf.on.startup(registry=registry)
    async def _start(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False  # we post our own Events, only on transitions
        settings.watching.server_timeout = 300
        settings.scanning.disabled = True  # watch the resources named here only
        controller.options = ReconcileOptions(
            pod_monitors=pod_monitors,
            leader_worker_sets=leader_worker_sets,
            operator_namespace=controller.config.operator_namespace,
            gateway_image=controller.config.gateway_image,
            policy=controller.config.policy,
        )
        if controller.kube.cache is None:
            # Reconciles read what the watches delivered (one LIST per kind at start), not
            # GETs: a steady state costs the API server watches and writes only.
            controller.kube.cache = WatchCache()
            await controller.start_informers(watched)
        if controller.config.metrics_port is not None:
            runner = web.AppRunner(controller.metrics.app(), access_log=None)
            await runner.setup()
            port = controller.config.metrics_port
            try:
                await web.TCPSite(runner, "0.0.0.0", port).start()
            except OSError as exc:  # kopf would retry each minute, reconciling nothing
                raise kopf.PermanentError(
                    f"cannot serve metrics on port {port}: {exc.strerror}"
                    " (another operator on this host? --metrics-port moves it, 0 turns it off)"
                ) from exc
            runners.append(runner)
        tasks.extend(
            [
                asyncio.create_task(controller.work()),
                asyncio.create_task(controller.resync()),
                asyncio.create_task(controller.autoscale()),
            ]
        )

    @kopf.on.cleanup(registry=registry)
    async def _stop(**_: Any) -> None:
        await asyncio.to_thread(controller.stop_informers)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for runner in runners:
            await runner.cleanup()

    @kopf.on.probe(id="progress", registry=registry)
    def _progress(**_: Any) -> dict[str, Any]:
        p = controller.progress()
        reason = stalled(p, controller.config.stall_s)
        if reason is not None:  # kopf's liveness endpoint answers 500 (a bare one: log why)
            log.error("liveness: %s", reason)
            raise kopf.PermanentError(reason)
        return {"pending": p.worker_pending, "queued": len(controller._queued)}

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def _isvc(
        *, type: str, name: str, namespace: str | None, body: kopf.Body, **_: Any
    ) -> None:
        if namespace is None:
            return
        if controller.kube.cache is not None:
            controller.kube.cache.observe(PLURAL, type, body)
        controller.service_changed(namespace)
        if type == "DELETED":
            controller.forget(namespace, name)
            return
        controller.known.add((namespace, name))
        controller.metrics.services.set(len(controller.known))
        controller.bodies[(namespace, name)] = dict(body)
        controller.enqueue(namespace, name)

    @kopf.on.event(GROUP, VERSION, IG_PLURAL, registry=registry)
    async def _gateway(
        *, type: str, name: str, namespace: str | None, body: kopf.Body, **_: Any
    ) -> None:
        if namespace is None:
            return
        if controller.kube.cache is not None:
            controller.kube.cache.observe(IG_PLURAL, type, body)
        key = (namespace, GATEWAY_KEY + name)
        if type == "DELETED":
            controller.gateways.discard(key)
            return
        controller.gateways.add(key)
        controller.enqueue(*key)

    watched = [
        *CHILD_KINDS,
        *(MONITORING_KINDS if pod_monitors else []),
        *(LWS_KINDS if leader_worker_sets else []),
    ]
    return registry


def run(controller: Controller, stop_flag: Any = None, ready_flag: Any = None) -> None:
    """Run the operator in this thread until `stop_flag` is set (or a signal arrives)."""
    pod_monitors = controller.kube.served("monitoring.coreos.com/v1")
    registry = make_registry(
        controller, pod_monitors, controller.kube.served("leaderworkerset.x-k8s.io/v1")
    )
    # A plain registry has no login handler: without this one kopf cannot log in at all.
    kopf.on.login(registry=registry)(kopf_login(controller.config.credentials))
    namespaces = list(controller.config.namespaces)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            liveness_endpoint=controller.config.liveness_endpoint,
        )
    )
