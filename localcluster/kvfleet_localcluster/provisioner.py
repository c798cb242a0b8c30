"""Persistent volumes for the local cluster: a provisioner, as a real cluster's storage
driver is.

A claim that nothing provisions stays Pending, and the real scheduler never places a pod
whose claim is unbound. So for every Pending claim the provisioner creates a PersistentVolume
pre-bound to it (`claimRef`), of the claim's class, size and access modes, backed by a
directory of the node (the same one the node agent mounts: `<state>/volumes/<ns>_<claim>`);
the controller manager's PV controller then binds the two, as it binds any pre-bound pair.
Data outlives the pods that use it and goes with the claim: a volume whose claim is deleted
(Released) is deleted too, with its directory.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kubeapi import PVCS, PVS, KubeClient
from kvfleet_localcluster.reflector import Reflector

log = logging.getLogger("kvfleet.provisioner")
Json = dict[str, Any]
PROVISIONER = "kvfleet.dev/local-directory"
ANNOTATION = "pv.kubernetes.io/provisioned-by"


def volume_for(claim: Json, directory: Path) -> Json:
    """The PersistentVolume that serves `claim`, pre-bound to it."""
    meta, spec = claim["metadata"], claim.get("spec") or {}
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {ANNOTATION: PROVISIONER}},
        "spec": {
            "capacity": {"storage": storage},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": spec.get("storageClassName") or "",
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "hostPath": {"path": str(directory / f"{meta['namespace']}_{meta['name']}")},
        },
    }


@dataclass
class Provisioner:
    client: KubeClient
    """With rights to create and delete PersistentVolumes (the cluster's admin)."""
    volumes_dir: Path
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.claims = Reflector(self.client, PVCS, self._dirty.set)
        self.volumes = Reflector(self.client, PVS, self._dirty.set)

    async def _sync(self) -> None:
        provisioned = {
            v["metadata"]["name"]: v
            for v in self.volumes.items.values()
            if (v["metadata"].get("annotations") or {}).get(ANNOTATION) == PROVISIONER
        }
        for claim in list(self.claims.items.values()):
            spec, meta = claim.get("spec") or {}, claim["metadata"]
            wanted = f"pvc-{meta['uid']}"
            if spec.get("volumeName") or wanted in provisioned or meta.get("deletionTimestamp"):
                continue
            try:
                await self.client.create(PVS, None, volume_for(claim, self.volumes_dir))
            except ApiError as exc:
                if exc.code != 409:
                    log.warning("claim %s/%s: %s", meta["namespace"], meta["name"], exc.message)
        for name, volume in provisioned.items():
            if (volume.get("status") or {}).get("phase") == "Released":
                try:
                    await self.client.delete(PVS, None, name)
                except ApiError as exc:
                    if exc.code != 404:
                        log.warning("volume %s: %s", name, exc.message)
                shutil.rmtree(volume["spec"]["hostPath"]["path"], ignore_errors=True)

    async def run(self) -> None:
        watches = [asyncio.create_task(r.run()) for r in (self.claims, self.volumes)]
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                await self._sync()
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
