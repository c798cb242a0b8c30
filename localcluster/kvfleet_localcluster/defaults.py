"""The defaults a real API server fills into built-in kinds on every write (Kubernetes 1.31's
`SetDefaults_*` functions of pkg/apis/core/v1, apps/v1, networking/v1, policy/v1 and rbac/v1,
and the Service registry's), so a client reading an object back sees what it would see on a
real cluster: fields it never wrote, which it must not mistake for drift.

Only the defaults of the fields the kinds kvfleet and its tests write carry; each is what the
server sets when the field is absent. Pure functions over the JSON object.
"""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

FILE_MODE = 420
"""0644: the default mode of ConfigMap, Secret, projected and downward-API volumes."""


def _probe(probe: Any) -> None:
    if not isinstance(probe, dict):
        return
    probe.setdefault("timeoutSeconds", 1)
    probe.setdefault("periodSeconds", 10)
    probe.setdefault("successThreshold", 1)
    probe.setdefault("failureThreshold", 3)
    http = probe.get("httpGet")
    if isinstance(http, dict):
        http.setdefault("path", "/")
        http.setdefault("scheme", "HTTP")


def _pull_policy(image: str) -> str:
    """Always for `:latest` or an untagged image, else IfNotPresent (a digest counts as a tag)."""
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.partition(":")[2]
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def _container(c: Any) -> None:
    if not isinstance(c, dict):
        return
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    if isinstance(c.get("image"), str):
        c.setdefault("imagePullPolicy", _pull_policy(c["image"]))
    for port in c.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        _probe(c.get(name))
    for env in c.get("env") or []:
        ref = ((env or {}).get("valueFrom") or {}).get("fieldRef")
        if isinstance(ref, dict):
            ref.setdefault("apiVersion", "v1")


def _volume(v: Any) -> None:
    if not isinstance(v, dict):
        return
    sources = set(v) - {"name"}
    if not sources:
        v["emptyDir"] = {}
    for source in ("configMap", "secret", "projected", "downwardAPI"):
        if isinstance(v.get(source), dict):
            v[source].setdefault("defaultMode", FILE_MODE)
    for item in (v.get("projected") or {}).get("sources") or []:
        token = (item or {}).get("serviceAccountToken")
        if isinstance(token, dict):
            token.setdefault("expirationSeconds", 3600)


def pod_spec(spec: Any) -> None:
    """`SetDefaults_PodSpec` and those of its containers, volumes and probes."""
    if not isinstance(spec, dict):
        return
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        _container(c)
    for v in spec.get("volumes") or []:
        _volume(v)


def _deployment(obj: Json) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    pod_spec((spec.get("template") or {}).get("spec"))


def _service(obj: Json) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["type"] != "ExternalName":
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec["type"] in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))


def _network_policy(obj: Json) -> None:
    spec = obj.setdefault("spec", {})
    if "policyTypes" not in spec:
        spec["policyTypes"] = ["Ingress", *(["Egress"] if spec.get("egress") else [])]
    for rule in [*(spec.get("ingress") or []), *(spec.get("egress") or [])]:
        for port in (rule or {}).get("ports") or []:
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")


def _role_binding(obj: Json) -> None:
    for subject in obj.get("subjects") or []:
        if isinstance(subject, dict) and subject.get("kind") in ("User", "Group"):
            subject.setdefault("apiGroup", "rbac.authorization.k8s.io")


def _pvc(obj: Json) -> None:
    obj.setdefault("spec", {}).setdefault("volumeMode", "Filesystem")


def _secret(obj: Json) -> None:
    obj.setdefault("type", "Opaque")


DEFAULTERS = {
    ("apps", "deployments"): _deployment,
    ("", "pods"): lambda obj: pod_spec(obj.setdefault("spec", {})),
    ("apps", "statefulsets"): lambda obj: pod_spec(
        ((obj.get("spec") or {}).get("template") or {}).get("spec")
    ),
    ("", "services"): _service,
    ("networking.k8s.io", "networkpolicies"): _network_policy,
    ("rbac.authorization.k8s.io", "rolebindings"): _role_binding,
    ("rbac.authorization.k8s.io", "clusterrolebindings"): _role_binding,
    ("", "persistentvolumeclaims"): _pvc,
    ("", "secrets"): _secret,
}


def default_builtin(group: str, plural: str, obj: Json) -> None:
    """Fill in the API server's defaults of a built-in object, in place."""
    defaulter = DEFAULTERS.get((group, plural))
    if defaulter is not None:
        defaulter(obj)
