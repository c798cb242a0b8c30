"""The product as the image ships it: runtime dependencies only, product packages only.

Run by `.ci/run` with the dev environment's Python (which starts the stand-ins):

1. Build a virtualenv the way the Dockerfile does: a source tree of the product folders
   alone (`operator/`, `gateway/`, `cli/`), `pip install` with no extras.
2. In it, import every product module, run every product command's `--help`, `render`,
   `crds --check`, `keys new`; a stand-in command must name its extra, not print a traceback.
3. Against the local cluster (a stand-in, from the dev environment) whose kvfleet-image pods
   run this install's `kvfleet`: `kubectl apply -k manifests/` deploys the operator, which
   runs as a pod under its ServiceAccount and logs in in-cluster (projected token, CA); it
   reconciles an example and its gateway pod serves a chat completion; `kvfleet gateway
   --backend` in front of an engine pod serves one too.

Exit status non-zero on the first failure, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("kernel", "operator", "gateway", "cli")
PRODUCT_PACKAGES = ("kvfleet_kernel", "kvfleet_operator", "kvfleet_gateway", "kvfleet_cli")
STAND_INS = ("kvfleet_sim", "kvfleet_localcluster", "kvfleet_bench")
DEV_ONLY = ("matplotlib", "sglang_router", "openai", "pytest", "transformers")
DEV_BIN = Path(sys.executable).parent


def step(what: str) -> None:
    print(f"runtime-only: {what}", flush=True)


def run(argv: list[str], *, ok: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    if ok and proc.returncode != 0:
        sys.exit(f"FAILED: {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}")
    return proc


def build_venv(work: Path) -> Path:
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PRODUCT:  # what the Dockerfile copies: the product, no stand-in
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-cache-dir", str(src)])
    return venv


IMPORT_ALL = """
import importlib, importlib.util, pkgutil, sys
product, stand_ins, dev_only = (arg.split(",") for arg in sys.argv[1:4])
count = 0
for name in product:
    pkg = importlib.import_module(name)
    for mod in pkgutil.walk_packages(pkg.__path__, name + "."):
        if mod.name.endswith(".__main__"):  # runs the command
            continue
        importlib.import_module(mod.name)
        count += 1
present = [m for m in stand_ins + dev_only if importlib.util.find_spec(m) is not None]
if present:
    sys.exit(f"the product install contains {present}")
loaded = [m for m in sys.modules if m.split(".")[0] in stand_ins + dev_only]
if loaded:
    sys.exit(f"product modules imported {loaded}")
print(count)
"""


def check_commands(venv: Path, work: Path) -> None:
    py, kvfleet = str(venv / "bin" / "python"), str(venv / "bin" / "kvfleet")
    n = run(
        [py, "-c", IMPORT_ALL, ",".join(PRODUCT_PACKAGES), ",".join(STAND_INS), ",".join(DEV_ONLY)]
    )
    step(f"imported {n.stdout.strip()} product modules; no stand-in or dev-only package installed")
    for cmd in (["--help"], ["operator", "--help"], ["gateway", "--help"], ["keys", "--help"]):
        run([kvfleet, *cmd])
    out = run([kvfleet, "render", "-f", str(ROOT / "examples" / "mistral-7b-manual.yaml")]).stdout
    assert "kind: Deployment" in out, out
    run([kvfleet, "crds", "--check", "--out", str(ROOT / "crds")])
    keys = run([kvfleet, "keys", "new", "--tenant", "ci"])
    assert "sha256:" in keys.stdout and "kvf-" in keys.stderr, keys
    for standin, extra in (("sim", "sim"), ("cluster", "cluster"), ("bench", "bench")):
        proc = run([kvfleet, standin, "--help"], ok=False)
        said = proc.stdout + proc.stderr
        if proc.returncode == 0 or f"kvfleet[{extra}]" not in said or "Traceback" in said:
            sys.exit(f"FAILED: `kvfleet {standin}` without its extra said:\n{said}")
    step("every product command starts; stand-in commands name their extra")


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    sys.exit(f"FAILED: timed out after {timeout:.0f}s waiting for {what}")


def chat(url: str, key: str) -> tuple[int, Any]:
    body = {"model": "mistral-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def end_to_end(venv: Path, work: Path) -> None:
    kubeconfig = work / "kubeconfig"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    kubectl = [str(DEV_BIN / "kubectl") if (DEV_BIN / "kubectl").exists() else "kubectl"]
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], log: str) -> None:
        with open(work / log, "wb") as out:
            procs.append(
                subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def pods(component: str) -> list[dict[str, Any]]:
        out = run([*kubectl, "get", "pods", "-n", "ai", "-o", "json", "-l",
                   f"app.kubernetes.io/component={component}"], env=env, ok=False)  # fmt: skip
        if out.returncode != 0:
            return []
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        return [
            p for p in items
            if any(c["type"] == "Ready" and c["status"] == "True"
                   for c in p.get("status", {}).get("conditions", []))
        ]  # fmt: skip

    try:
        spawn(
            [str(DEV_BIN / "kvfleet"), "cluster", "up", "--kubeconfig", str(kubeconfig),
             "--no-lws", "--crds", str(ROOT / "crds"), "--state-dir", str(work / "state"),
             "--kvfleet-image-command", str(venv / "bin" / "kvfleet")],
            "cluster.log",
        )  # fmt: skip
        # The real control plane (built before `make test`): its kubeconfig appears once the
        # cluster is ready for pods, 10-30 s after the start.
        until(kubeconfig.exists, 120, "the cluster's kubeconfig")
        # The operator as users install it: its pod runs this install's `kvfleet` under the
        # kvfleet-operator ServiceAccount and logs in with the token the kubelet projects.
        run([*kubectl, "apply", "-k", str(ROOT / "manifests")], env=env)
        run([*kubectl, "rollout", "status", "deployment/kvfleet-operator", "-n",
             "kvfleet-system", "--timeout=60s"], env=env)  # fmt: skip
        for name in ("api-keys-secret.yaml", "mistral-7b-manual.yaml"):
            run([*kubectl, "apply", "-f", str(ROOT / "examples" / name)], env=env)
        run([*kubectl, "wait", "--for=condition=Ready", "kis/mistral", "-n", "ai",
             "--timeout=90s"], env=env)  # fmt: skip
        gateway = until(lambda: pods("gateway"), 30, "a ready gateway pod")[0]
        url = f"http://{gateway['status']['podIP']}:8080"
        _, body = until(lambda: (r := chat(url, "foo"))[0] == 200 and r, 30, "a completion")
        step(f"the operator pod (in-cluster login) reconciled mistral; its gateway served: "
             f"{body['usage']}")  # fmt: skip

        engine = pods("engine")[0]["status"]["podIP"]
        keys = work / "keys.yaml"
        keys.write_text(run([*kubectl, "get", "secret", "ai-api-keys", "-n", "ai", "-o",
                             "jsonpath={.data.keys\\.yaml}"], env=env).stdout)  # fmt: skip
        import base64

        keys.write_bytes(base64.b64decode(keys.read_text()))
        # The engines answer only a gateway holding their key (the operator's Secret).
        engine_key = work / "engine-key"
        engine_key.write_bytes(base64.b64decode(run(
            [*kubectl, "get", "secret", "mistral-engine-key", "-n", "ai", "-o",
             "jsonpath={.data.key}"], env=env).stdout))  # fmt: skip
        gw_port = free_port()
        spawn(
            [str(venv / "bin" / "kvfleet"), "gateway", "--backend", f"http://{engine}:30000",
             "--port", str(gw_port), "--host", "127.0.0.1", "--keys", str(keys),
             "--engine-api-key-file", str(engine_key)],
            "gateway.log",
        )  # fmt: skip
        gw = f"http://127.0.0.1:{gw_port}"
        _, body = until(lambda: (r := chat(gw, "foo"))[0] == 200 and r, 30, "a completion")
        step(f"kvfleet gateway --backend {engine} served: {body['usage']}")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        for log in sorted(work.glob("*.log")):
            if log.stat().st_size and any(p.returncode not in (0, -15) for p in procs):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def main() -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvfleet-runtime-only-") as tmp:
        work = Path(tmp)
        step("building a virtualenv with runtime dependencies only (as the Dockerfile does)")
        venv = build_venv(work)
        check_commands(venv, work)
        end_to_end(venv, work)
    step(f"passed in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
