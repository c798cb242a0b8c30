"""Kubernetes Pod Security Standards, checked on a pod spec: the `baseline` and `restricted`
profiles' rules as the Pod Security admission controller applies them (policy version
v1.30+: https://kubernetes.io/docs/concepts/security/pod-security-standards/). Each rule
returns what it found wrong, in the admission controller's own terms."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Json = dict[str, Any]

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
        "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
    }
)  # fmt: skip
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
        "projected", "secret",
    }
)  # fmt: skip


def _containers(pod: Json) -> Iterator[Json]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or []


def _baseline(pod: Json) -> Iterator[str]:
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            yield f"host namespaces ({key}=true)"
    for v in pod.get("volumes") or []:
        if "hostPath" in v:
            yield f"hostPath volumes ({v['name']})"
    sc = pod.get("securityContext") or {}
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield "seccompProfile (pod must not set type=Unconfined)"
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        yield "appArmorProfile (pod must not set type=Unconfined)"
    for s in sc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            yield f"forbidden sysctls ({s['name']})"
    if (sc.get("seLinuxOptions") or {}).get("user") or (sc.get("seLinuxOptions") or {}).get("role"):
        yield "seLinuxOptions (user or role set)"
    for c in _containers(pod):
        csc = c.get("securityContext") or {}
        name = c["name"]
        if csc.get("privileged"):
            yield f"privileged (container {name!r} must not set privileged=true)"
        added = set((csc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            yield f"non-default capabilities (container {name!r}: {sorted(added)})"
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                yield f"hostPort (container {name!r} uses hostPort {p['hostPort']})"
        if (csc.get("seccompProfile") or {}).get("type") == "Unconfined":
            yield f"seccompProfile (container {name!r} must not set type=Unconfined)"
        if csc.get("procMount") not in (None, "Default"):
            yield f"procMount (container {name!r})"
        selinux = csc.get("seLinuxOptions") or {}
        if selinux.get("user") or selinux.get("role"):
            yield f"seLinuxOptions (container {name!r})"


def _restricted(pod: Json, *, allow_root: bool) -> Iterator[str]:
    yield from _baseline(pod)
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"restricted volume types ({v['name']}: {sorted(kinds)})"
    sc = pod.get("securityContext") or {}
    for c in _containers(pod):
        csc = c.get("securityContext") or {}
        name = c["name"]
        if csc.get("allowPrivilegeEscalation") is not False:
            yield f"allowPrivilegeEscalation != false (container {name!r})"
        dropped = (csc.get("capabilities") or {}).get("drop") or []
        if "ALL" not in dropped:
            yield f"unrestricted capabilities (container {name!r} must drop ALL)"
        added = set((csc.get("capabilities") or {}).get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            yield f"unrestricted capabilities (container {name!r} adds {sorted(added)})"
        seccomp = (csc.get("seccompProfile") or sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"seccompProfile (container {name!r} must be RuntimeDefault or Localhost)"
        non_root = csc.get("runAsNonRoot", sc.get("runAsNonRoot"))
        if not allow_root and non_root is not True:
            yield f"runAsNonRoot != true (container {name!r})"
        if csc.get("runAsUser", sc.get("runAsUser")) == 0:
            yield f"runAsUser=0 (container {name!r})"


def baseline_violations(pod: Json) -> list[str]:
    return list(_baseline(pod))


def restricted_violations(pod: Json, *, allow_root: bool = False) -> list[str]:
    """`allow_root`: every restricted rule but runAsNonRoot (an image that must run as root)."""
    return list(_restricted(pod, allow_root=allow_root))


Check = Callable[[Json], list[str]]
