"""Local clusters on the real control plane as the tests share them: one per test worker and
kind of node (pods Ready without processes, or pods as processes), started by the first test
that asks, each test in a namespace of its own.

A cluster runs in a thread with an event loop of its own, so it outlives every test's loop
and keeps serving while a test blocks its own (a synchronous client call, a thread join).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvfleet_localcluster.local import LocalCluster, LocalClusterConfig
from kvfleet_operator.kube import Kube, Resource
from kvfleet_operator.login import Credentials, api_client

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
NAMESPACE = Resource("v1", "Namespace", "namespaces", namespaced=False)
SERVICE_ACCOUNT = Resource("v1", "ServiceAccount", "serviceaccounts")
TEST_LABEL = "kvfleet.dev/test"
"""On every test's namespace: the test that made it."""


class ClusterThread:
    """A `LocalCluster` served by its own event loop in a thread of its own."""

    def __init__(self, config: LocalClusterConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.cluster = LocalCluster(config)
        self.thread.start()
        started = time.monotonic()
        try:
            self._call(self.cluster.__aenter__(), START_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            raise
        self.startup_s = time.monotonic() - started
        self.admin = Kube(api_client(Credentials(kubeconfig=str(config.kubeconfig))))
        self.kubeconfigs = config.kubeconfig.parent / "namespaces"
        self.kubeconfigs.mkdir(exist_ok=True)
        self._names = itertools.count(1)

    def _call(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_TIMEOUT_S)
        if not self.thread.is_alive():
            self.loop.close()

    def close(self) -> None:
        try:
            self._call(self.cluster.__aexit__(None, None, None), STOP_TIMEOUT_S)
        finally:
            self._stop_loop()

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.cluster.control_plane.ports.etcd_client}"

    def namespace_kubeconfig(self, namespace: str) -> Path:
        """A copy of the admin kubeconfig whose context's namespace is `namespace` (kubectl
        and the operator default to it), beside the others: they share kubectl's cache."""
        doc = yaml.safe_load(self.cluster.kubeconfig.read_text())
        for context in doc["contexts"]:
            context["context"]["namespace"] = namespace
        path = self.kubeconfigs / f"{namespace}.kubeconfig"
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path

    def create_namespace(self, test_name: str) -> str:
        """A new namespace named after the test, once its `default` ServiceAccount exists
        (a pod created before the controller manager made it is refused)."""
        slug = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:40].strip("-")
        name = f"{slug}-{next(self._names)}"
        doc = {"metadata": {"name": name, "labels": {TEST_LABEL: slug}}}
        self.admin.request("POST", NAMESPACE.path(None), doc)
        deadline = time.monotonic() + 30
        while self.admin.get(SERVICE_ACCOUNT, name, "default") is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"namespace {name}: no default ServiceAccount after 30 s")
            time.sleep(0.05)
        return name

    def delete_namespace(self, name: str) -> None:
        """Deleted in the background: the namespace controller empties it while the next test
        runs in a namespace of its own."""
        with contextlib.suppress(Exception):
            self.admin.request("DELETE", NAMESPACE.path(None, name))


class WorkerClusters:
    """This worker's shared clusters, by kind, each started on first use."""

    def __init__(self, root: Path, configs: dict[str, Any]) -> None:
        self.root, self.configs = root, configs
        self.clusters: dict[str, ClusterThread] = {}

    def get(self, kind: str) -> ClusterThread:
        if kind not in self.clusters:
            self.clusters[kind] = ClusterThread(self.configs[kind](self.root / kind))
            print(f"shared cluster {kind!r} up in {self.clusters[kind].startup_s:.1f} s")
        return self.clusters[kind]

    def close(self) -> None:
        for cluster in self.clusters.values():
            with contextlib.suppress(Exception):
                cluster.close()


class AuditLog:
    """The API server's audit log (JSON lines) from a mark on: `AuditLog(path)` marks its
    current end (`from_start`: its beginning); `events()` are those written since."""

    def __init__(self, path: Path, from_start: bool = False) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() and not from_start else 0

    def events(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        # A line being written has no newline yet: only whole lines.
        whole = data[: data.rfind(b"\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def iter_complete(self) -> Iterator[dict[str, Any]]:
        """One event per request: its ResponseComplete stage."""
        return (e for e in self.events() if e.get("stage") == "ResponseComplete")


async def compact_etcd(etcd_url: str) -> int:
    """Compact etcd's history up to its current revision (as the API server's periodic
    compaction does, but now), through etcd's JSON gateway; the revision compacted to. A
    watch from an older resourceVersion is then answered 410 Gone."""
    import aiohttp

    async with aiohttp.ClientSession(etcd_url) as http:
        async with http.post("/v3/kv/range", json={"key": "Lw=="}) as resp:  # key "/"
            resp.raise_for_status()
            revision = int((await resp.json())["header"]["revision"])
        body = {"revision": revision, "physical": True}
        async with http.post("/v3/kv/compaction", json=body) as resp:
            resp.raise_for_status()
    return revision
