"""Namespaced mode as a team installs it: `kubectl apply -k manifests/namespaced/` binds the
operator's ClusterRole in namespace `ai` only. The operator runs with exactly the arguments
of the Deployment that kustomize renders, logged in as its ServiceAccount (a token from the
TokenRequest API), so the local cluster's RBAC decides every request: it reconciles the
InferenceService in `ai`, never touches the one in `other`, and could not if it tried.

A cluster of the test's own: the manifests install cluster-scoped things (the CRD, the
ClusterRole, `kvfleet-system`) and name namespace `ai`; the API server's audit log says
what the operator asked and whether RBAC allowed it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import yaml

from kvfleet_localcluster.local import LocalCluster
from tests.support.cluster import AUDIT_LOG, cluster_config
from tests.support.kubectl import kubectl
from tests.support.objects import ROOT, isvc
from tests.support.shared_cluster import AuditLog

OPERATOR = "system:serviceaccount:kvfleet-system:kvfleet-operator"


def rendered_operator_args(kubeconfig: Path) -> list[str]:
    """The operator container's arguments as `kubectl kustomize manifests/namespaced` has them,
    but for the liveness endpoint (a fixed port the test does not need)."""
    import subprocess

    from tests.conftest import kubectl_binary

    done = subprocess.run(
        [kubectl_binary(), "kustomize", str(ROOT / "manifests" / "namespaced")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    deployment = next(d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Deployment")
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    i = args.index("--liveness")
    return args[:i] + args[i + 2 :]


def service_account_kubeconfig(admin: Path, token: str, out: Path) -> Path:
    doc = yaml.safe_load(admin.read_text())
    doc["users"] = [{"name": "kvfleet-admin", "user": {"token": token}}]
    out.write_text(yaml.safe_dump(doc))
    return out


async def test_namespaced_mode_reconciles_its_namespace_and_cannot_touch_another(
    tmp_path: Path,
) -> None:
    config = cluster_config(tmp_path, crds=False)
    async with LocalCluster(config) as cluster:
        kc = cluster.kubeconfig

        async def k(*args: str, stdin: str | None = None) -> str:
            return await kubectl(kc, *args, stdin=stdin)

        await k("create", "namespace", "other")
        await k("apply", "-k", str(ROOT / "manifests" / "namespaced"))
        token = (await k("create", "token", "kvfleet-operator", "-n", "kvfleet-system")).strip()
        sa_kc = service_account_kubeconfig(kc, token, tmp_path / "operator.kubeconfig")
        for ns in ("ai", "other"):
            body = isvc("llama", ns, gateway={"enabled": False}, replicas=1)
            await k("apply", "-f", "-", stdin=json.dumps(body))
        # The platform's policy (an operator flag): this author's own image is refused.
        rogue = isvc("rogue", "ai", gateway={"enabled": False}, replicas=1,
                     engine={"gpuType": "h100", "image": "evil.example/sglang:latest"})  # fmt: skip
        await k("apply", "-f", "-", stdin=json.dumps(rogue))

        kvfleet = str(Path(sys.executable).parent / "kvfleet")
        argv = [*rendered_operator_args(kc), "--kubeconfig", str(sa_kc), "--metrics-port", "0",
                "--allowed-image-prefix", "lmsysorg/sglang"]  # fmt: skip
        assert argv[:3] == ["operator", "--namespace", "ai"], argv
        proc = await asyncio.create_subprocess_exec(
            kvfleet, *argv, env={**os.environ, "OPERATOR_NAMESPACE": "kvfleet-system"},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out = await k("wait", "--for=condition=Ready", "kis/llama", "-n", "ai", "--timeout=90s")
            assert "condition met" in out
            out = await k(
                "wait", "--for=jsonpath={.status.conditions[?(@.type=='Ready')].reason}"
                "=PolicyViolation", "kis/rogue", "-n", "ai", "--timeout=30s",
            )  # fmt: skip
            assert "condition met" in out
            await asyncio.sleep(2)  # a resync's worth: `other` would have been seen by now
        finally:
            proc.terminate()
            _, err = await proc.communicate()
        log = AuditLog(tmp_path / AUDIT_LOG, from_start=True).events()
        mine = [e for e in log if e["user"]["username"] == OPERATOR]
        assert mine, err.decode()[-2000:]
        # Every namespaced request of the operator was in `ai` (cluster-scoped: discovery
        # only), and RBAC never had to refuse one: it does not even try elsewhere.
        namespaces = {(e.get("objectRef") or {}).get("namespace", "") for e in mine}
        assert namespaces <= {"ai", ""}, namespaces
        denied = [e for e in mine if (e.get("responseStatus") or {}).get("code") == 403]
        assert not denied, [(e["verb"], e["requestURI"]) for e in denied]
        refused = json.loads(await k("get", "kis", "rogue", "-n", "ai", "-o", "json"))
        ready = next(c for c in refused["status"]["conditions"] if c["type"] == "Ready")
        assert ready["message"].startswith("spec.engine.image: image 'evil.example/sglang:latest'")
        assert "lmsysorg/sglang" in ready["message"], ready
        assert "rogue" not in await k("get", "deployments", "-n", "ai", "-o", "name")
        events = await k("get", "events", "-n", "ai", "--field-selector",
                         "involvedObject.name=rogue", "-o", "json")  # fmt: skip
        assert "PolicyViolation" in {e["reason"] for e in json.loads(events)["items"]}
        other = json.loads(await k("get", "kis", "llama", "-n", "other", "-o", "json"))
        assert not other.get("status"), other["status"]
        assert not (await k("get", "deployments", "-n", "other", "-o", "name")).strip()
        # And it could not: its ServiceAccount may write children in `ai` only.
        as_operator = ("--as", OPERATOR)
        for ns, answer in (("ai", "yes"), ("other", "no"), ("kvfleet-system", "no")):
            code, said = await can_i(kc, "create", "deployments", "-n", ns, *as_operator)
            assert said == answer, (ns, said, code)
        _, said = await can_i(kc, "list", "inferenceservices.kvfleet.dev", "-A", *as_operator)
        assert said == "no"
        # Nor can it borrow anyone's rights: impersonation is a verb it is not granted.
        code, said = await can_i(sa_kc, "create", "deployments", "-n", "other", "--as", "admin")
        assert code != 0 and said != "yes", said


async def can_i(kubeconfig: Path, *args: str) -> tuple[int, str]:
    """`kubectl auth can-i` exits 1 when the answer is no; the answer is what it prints."""
    from tests.conftest import kubectl_binary

    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(), "--kubeconfig", str(kubeconfig), "auth", "can-i", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    return int(proc.returncode or 0), (out or err).decode().strip()
