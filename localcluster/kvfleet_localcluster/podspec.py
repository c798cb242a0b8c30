"""What the kubelet makes of a pod's spec before its process starts: volumes on disk, the
service-account volume, the environment (values, Secret and ConfigMap keys, the downward
API), `$(VAR)` expansion, and whether every Secret, ConfigMap, key and PVC it references
exists (`ConfigMissing` holds the container until they do).

No mount namespaces exist here: each volume is a directory of the pod, and its mountPath is
substituted by that directory in the command line, environment and mounted text files; the
service-account volume, whose path client libraries hard-code, is redirected inside the
process by the pod shim (`podshim/sitecustomize.py`, through PYTHONPATH), which also binds
wildcard listeners to the pod's address.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]
SHIM_DIR = Path(__file__).parent / "podshim"
SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ClusterAccess:
    """How a pod reaches the API server: what the kubelet puts in its service-account volume
    and environment."""

    host: str
    port: int
    ca_pem: bytes
    issue_token: Callable[[str, str], str]
    """(namespace, service account) → a token (the TokenRequest API)."""


class ConfigMissing(Exception):
    """A referenced Secret, ConfigMap, key or PVC does not exist: the container cannot start."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def substitute(text: str, mounts: dict[str, Path]) -> str:
    """Mount paths → their local directories, in one pass (a replaced path is never
    rewritten again), longest mount first, only at path boundaries."""
    if not mounts:
        return text
    paths = sorted((m.rstrip("/") for m in mounts), key=len, reverse=True)
    local = {m.rstrip("/"): str(d) for m, d in mounts.items()}
    pattern = re.compile("(" + "|".join(map(re.escape, paths)) + r")(?=/|$|[\s\"',])")
    return pattern.sub(lambda m: local[m.group(1)], text)


@dataclass(frozen=True)
class PodSandbox:
    """One pod's identity and references, as its containers will see them."""

    ns: str
    name: str
    pod_ip: str
    spec: Json
    meta: Json
    pod_dir: Path
    secrets: Any
    """Callable(ns, kind, name) -> object | None, reading ConfigMaps, Secrets and PVCs."""
    access: ClusterAccess | None
    volumes_dir: Path
    """Where PersistentVolumeClaims' volumes live on this node (they outlive pods)."""
    service_table: Path
    """The node's Service table, which the pod shim resolves Service names from."""

    def materialize(self, container: Json) -> dict[str, Path]:
        volumes = {v["name"]: v for v in self.spec.get("volumes") or []}
        mounts: dict[str, Path] = {}
        for m in container.get("volumeMounts") or []:
            vol = volumes.get(m["name"], {})
            local = self.pod_dir / "volumes" / m["name"]
            if claim := (vol.get("persistentVolumeClaim") or {}).get("claimName"):
                # The claim's volume outlives the pod: a replaced pod finds its data again.
                local = self.volumes_dir / f"{self.ns}_{claim}"
            local.mkdir(parents=True, exist_ok=True)
            files: dict[str, bytes] = {}
            if "configMap" in vol:
                cm = self.secrets(self.ns, "ConfigMap", vol["configMap"]["name"]) or {}
                files = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
            elif "secret" in vol:
                sec = self.secrets(self.ns, "Secret", vol["secret"]["secretName"]) or {}
                files = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
                files |= {k: v.encode() for k, v in (sec.get("stringData") or {}).items()}
            for key, data in files.items():
                (local / key).write_bytes(data)
            mounts[m["mountPath"]] = local
        if self.access is not None and self.spec.get("automountServiceAccountToken") is not False:
            mounts[SERVICE_ACCOUNT_PATH] = self.service_account_volume(self.access)
        for m in container.get("volumeMounts") or []:  # mounted text refers to other mounts
            if "configMap" in volumes.get(m["name"], {}):
                for f in mounts[m["mountPath"]].iterdir():
                    f.write_text(substitute(f.read_text(), mounts))
        return mounts

    def refresh_secrets(self, container: Json) -> int:
        """The kubelet's periodic sync of mounted Secrets: files whose Secret changed are
        replaced atomically (a reader sees the old file or the new one); returns how many."""
        volumes = {v["name"]: v for v in self.spec.get("volumes") or []}
        changed = 0
        for m in container.get("volumeMounts") or []:
            source = volumes.get(m["name"], {}).get("secret")
            if source is None:
                continue
            sec = self.secrets(self.ns, "Secret", source["secretName"])
            if sec is None:
                continue  # deleted: a node keeps the last content it had
            local = self.pod_dir / "volumes" / m["name"]
            files = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
            for key, data in files.items():
                target = local / key
                if not target.exists() or target.read_bytes() != data:
                    staged = local / f".{key}.new"
                    staged.write_bytes(data)
                    staged.replace(target)
                    changed += 1
            for stale in [f for f in local.iterdir() if f.name not in files]:
                if not stale.name.startswith("."):
                    stale.unlink()
                    changed += 1
        return changed

    def service_account_volume(self, access: ClusterAccess) -> Path:
        """What the kubelet projects into every pod: a token, the CA, the namespace."""
        local = self.pod_dir / "volumes" / "kube-api-access"
        local.mkdir(parents=True, exist_ok=True)
        account = self.spec.get("serviceAccountName") or "default"
        (local / "token").write_text(access.issue_token(self.ns, account))
        (local / "ca.crt").write_bytes(access.ca_pem)
        (local / "namespace").write_text(self.ns)
        return local

    def _field(self, path: str) -> str:
        """The downward API's `fieldRef.fieldPath`."""
        labels = self.meta.get("labels") or {}
        annotations = self.meta.get("annotations") or {}
        if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
            return str((labels if m.group(1) == "labels" else annotations).get(m.group(2), ""))
        values = {
            "metadata.name": self.name,
            "metadata.namespace": self.ns,
            "metadata.uid": str(self.meta.get("uid", "")),
            "spec.nodeName": str(self.spec.get("nodeName") or "local"),
            "spec.serviceAccountName": self.spec.get("serviceAccountName") or "default",
            "status.podIP": self.pod_ip,
            "status.podIPs": self.pod_ip,
            "status.hostIP": "127.0.0.1",
        }
        if path not in values:
            raise ConfigMissing("CreateContainerConfigError", f"unsupported fieldPath {path!r}")
        return values[path]

    def _key_value(self, kind: str, ref: Json) -> str | None:
        obj = self.secrets(self.ns, kind, ref.get("name", ""))
        optional = bool(ref.get("optional"))
        if obj is None:
            if optional:
                return None
            raise ConfigMissing(
                "CreateContainerConfigError", f'{kind.lower()} "{ref.get("name")}" not found'
            )
        data = obj.get("data") or {}
        if ref.get("key") not in data:
            if optional:
                return None
            raise ConfigMissing(
                "CreateContainerConfigError",
                f"couldn't find key {ref.get('key')} in {kind} {self.ns}/{ref.get('name')}",
            )
        raw = data[ref["key"]]
        return base64.b64decode(raw).decode() if kind == "Secret" else str(raw)

    def check_references(self, container: Json) -> None:
        """Raise ConfigMissing as the kubelet would before creating the container."""
        for vol in self.spec.get("volumes") or []:
            for kind, key, name_key in (
                ("Secret", "secret", "secretName"),
                ("ConfigMap", "configMap", "name"),
                ("PersistentVolumeClaim", "persistentVolumeClaim", "claimName"),
            ):
                src = vol.get(key)
                if src is None or src.get("optional"):
                    continue
                if self.secrets(self.ns, kind, src.get(name_key, "")) is None:
                    raise ConfigMissing(
                        "ContainerCreating",
                        f'MountVolume.SetUp failed for volume "{vol.get("name")}" : '
                        f'{kind.lower()} "{src.get(name_key)}" not found',
                    )
        for src in container.get("envFrom") or []:
            for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                ref = src.get(key)
                if (
                    ref
                    and not ref.get("optional")
                    and self.secrets(self.ns, kind, ref.get("name", "")) is None
                ):
                    raise ConfigMissing(
                        "CreateContainerConfigError",
                        f'{kind.lower()} "{ref.get("name")}" not found',
                    )
        self.env(container, {})

    def env(self, container: Json, mounts: dict[str, Path]) -> dict[str, str]:
        env = dict(os.environ)
        for leaked in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            env.pop(leaked, None)  # a pod sees the cluster as a pod does, not as its host
        if self.access is not None:
            env["KUBERNETES_SERVICE_HOST"] = self.access.host
            env["KUBERNETES_SERVICE_PORT"] = str(self.access.port)
        env["KVFLEET_POD_IP"] = self.pod_ip
        env["KVFLEET_POD_NAMESPACE"] = self.ns  # the DNS search path: `redis` is redis.<ns>
        env["KVFLEET_SERVICE_TABLE"] = str(self.service_table)
        # Only the service-account path goes through the shim: libraries hard-code it, while
        # every other mount is substituted in the command line, env and files above — and
        # remapping, say, a pod's /tmp would hide the host's /tmp the process runs from.
        shimmed = {m: str(d) for m, d in mounts.items() if m == SERVICE_ACCOUNT_PATH}
        env["KVFLEET_POD_MOUNTS"] = json.dumps(shimmed)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p
        )
        for src in container.get("envFrom") or []:
            for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                ref = src.get(key)
                obj = self.secrets(self.ns, kind, ref.get("name", "")) if ref else None
                for k, v in ((obj or {}).get("data") or {}).items():
                    value = base64.b64decode(v).decode() if kind == "Secret" else str(v)
                    env[f"{src.get('prefix', '')}{k}"] = value
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            if "value" in var:
                env[var["name"]] = substitute(str(var["value"]), mounts)
            elif ref := source.get("secretKeyRef"):
                if (secret := self._key_value("Secret", ref)) is not None:
                    env[var["name"]] = secret
            elif ref := source.get("configMapKeyRef"):
                if (config := self._key_value("ConfigMap", ref)) is not None:
                    env[var["name"]] = config
            elif ref := source.get("fieldRef"):
                env[var["name"]] = self._field(ref.get("fieldPath", ""))
        return env

    def expand(self, container: Json, mounts: dict[str, Path]) -> Json:
        """`$(VAR)` in command and args from the container's own env, as the kubelet expands
        them (`$$` escapes; an undefined reference stays as written)."""
        env = self.env(container, mounts)
        own = {v["name"] for v in container.get("env") or []}

        def expand(text: str) -> str:
            def one(m: re.Match[str]) -> str:
                if m.group(0) == "$$":
                    return "$"
                name = m.group(1)
                return env[name] if name in own and name in env else m.group(0)

            return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)

        return {
            **container,
            "command": [expand(str(a)) for a in container.get("command") or []],
            "args": [expand(str(a)) for a in container.get("args") or []],
        }
