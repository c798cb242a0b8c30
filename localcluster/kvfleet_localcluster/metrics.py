"""The API server's own metrics at `/metrics`, named as kube-apiserver names them.

`apiserver_request_total{verb,group,resource,code}` and
`apiserver_request_duration_seconds{verb}` (watches and followed logs excluded, as the real
server's latency SLO excludes them), plus `kvfleet_local_apiserver_requests_by_user_total`
— a local-cluster addition that says which client (user) cost what, for the scale
benchmark's per-service request budget.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvfleet_localcluster.auth import Attributes, User

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ApiServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "apiserver_request_total",
            "Requests by verb, API group, resource and HTTP code.",
            ["verb", "group", "resource", "code"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "apiserver_request_duration_seconds",
            "Time to serve a request (watches and followed logs excluded).",
            ["verb"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.by_user = Counter(
            "kvfleet_local_apiserver_requests_by_user",
            "Requests by authenticated user and verb.",
            ["user", "verb"],
            registry=self.registry,
        )

    def observe(
        self, user: User | None, attrs: Attributes, code: int, seconds: float, streaming: bool
    ) -> None:
        verb = attrs.verb.upper()
        resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
        self.requests.labels(verb, attrs.group, resource, str(code)).inc()
        if not streaming:
            self.duration.labels(verb).observe(seconds)
        if user is not None:
            self.by_user.labels(user.name, verb).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
