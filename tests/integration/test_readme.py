"""Every command in README.md runs, as written, in a shell — or names the test that runs it.

The README's `sh` blocks are parsed (continuation lines joined, comments dropped) and run by
bash in a copy of the repository's manifests, examples and charts, with the installed
`kvfleet`, kubectl and helm on the PATH: the simulator and gateway walkthrough on this
machine; the local cluster's walkthrough, the install steps, the admin CLI and the
autoscaler's commands on one local cluster (with the Prometheus Operator's CRDs, so the
monitoring step applies); the Helm install on a fresh one. A command that fails fails the
test with its output. Commands that run for good (servers, `top`) are started, checked and
stopped; the few the shell cannot run here name where they are run instead."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import dev_binary, kubectl_binary, require_binary
from tests.support.objects import ROOT

README = ROOT / "README.md"
RUN_ELSEWHERE = {
    "make demo": ".ci/run runs it as typed, after make test, in CI's clean clone "
    "(tests/integration/test_demo.py types `kvfleet demo --quick` in a fresh directory)",
    "make test": "CI (.ci/run) runs it",
    ". .venv/bin/activate": "these tests run with the venv's bin/ first on PATH, as it puts it",
    "kvfleet gateway --config gateway.yaml": "every gateway pod runs it with the rendered config",
    "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
    "v0.9.0/manifests.yaml": "no network here: tests/integration/test_multinode_in_cluster.py "
    "applies that release's CRD (tests/data/leaderworkerset/) with --server-side, and the local "
    "cluster runs its controller",
    "kubectl apply -f examples/deepseek-v3-2x8-h100.yaml": "tests/integration/"
    "test_multinode_in_cluster.py, after LeaderWorkerSet is installed",
    "kubectl get lws -n ai": "tests/integration/test_multinode_in_cluster.py (its columns)",
}
"""Commands the README test does not run itself, and where they run."""
CHANGED = {
    "/tmp/kvfleet.kubeconfig": "the test's own directory (tests run in parallel with a user's)",
}
"""What this test changes in a command before it runs it; nothing else is changed, and
nothing is installed that the README does not install."""
SERVERS = {
    "kvfleet sim serve": "curl -sf http://127.0.0.1:30000/health",
    "kvfleet gateway --backend": "curl -sf http://127.0.0.1:8080/healthz",
}
"""Long-running commands: started in the background; ready when the check passes."""
FOR_A_WHILE = {
    "kvfleet top": "llama-8b-engine-",
    "kvfleet operator": "",
}
"""Commands that run until stopped: run for a few seconds; their output must contain this."""


def readme_blocks() -> list[tuple[str, list[str]]]:
    """(the heading above it, its commands) for every ```sh block."""
    blocks: list[tuple[str, list[str]]] = []
    heading, lines, inside = "", README.read_text().splitlines(), False
    commands: list[str] = []
    for line in lines:
        if line.startswith("#") and not inside:
            heading = line.lstrip("# ").strip()
        elif line.strip() == "```sh":
            inside, commands = True, []
        elif line.strip() == "```" and inside:
            inside = False
            blocks.append((heading, commands))
        elif inside:
            text = re.sub(r"\s{2,}#\s.*$", "", line).rstrip()
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            if commands and commands[-1].endswith("\\"):
                commands[-1] = commands[-1][:-1].rstrip() + " " + text.strip()
            else:
                commands.append(text.strip())
    return blocks


def block(heading: str) -> list[str]:
    found = [cmds for h, cmds in readme_blocks() if h == heading]
    assert found, f"README has no sh block under {heading!r}"
    return found[0]


def _script(commands: list[str], work: Path) -> str:
    out = [
        "set -u",
        "PIDS=''",
        "trap 'kill $PIDS 2>/dev/null; wait 2>/dev/null' EXIT",
    ]
    for n, cmd in enumerate(commands):
        out.append(f"echo {shlex.quote('::: ' + cmd)}")
        server = next((chk for p, chk in SERVERS.items() if cmd.startswith(p)), None)
        running = next((want for p, want in FOR_A_WHILE.items() if cmd.startswith(p)), None)
        if server is not None:
            out += [
                f"{cmd} > {work}/server-{n}.log 2>&1 &",
                'PIDS="$PIDS $!"',
                f"for i in $(seq 150); do {server} >/dev/null && break; sleep 0.2; done",
                f"{server} >/dev/null || "
                f"{{ cat {work}/server-{n}.log; echo '::: FAILED'; exit 1; }}",
            ]
        elif running is not None:
            # Run in the foreground (a background job would ignore Ctrl-C). A screen to show
            # gets up to 25 s (`kvfleet top`'s first one took over 8 s at load 12) and its
            # Ctrl-C as soon as it shows what it must, from a watcher that knows its pid.
            seconds = 25 if running else 8
            log, pid = f"{work}/run-{n}.log", f"{work}/run-{n}.pid"
            if running:
                out.append(
                    f"( for i in $(seq {seconds * 10}); do grep -q {shlex.quote(running)} {log} "
                    f"2>/dev/null && break; sleep 0.1; done; kill -INT $(cat {pid}) 2>/dev/null ) &"
                )
            inner = shlex.quote(f"echo $$ > {pid}; exec {cmd}")
            out += [
                f"timeout -s INT {seconds} bash -c {inner} > {log} 2>&1",
                f"grep -q {shlex.quote(running)} {log} || "
                f"{{ cat {log}; echo '::: FAILED'; exit 1; }}",
            ]
        elif cmd.endswith("&") and " port-forward " in cmd:  # wait for its local port
            local = re.search(r" (\d+):\d+ ", cmd + " ")
            assert local, cmd
            port = local.group(1)
            out += [
                f"{cmd[:-1]} > {work}/forward-{n}.log 2>&1 &",
                'PIDS="$PIDS $!"',
                f"for i in $(seq 150); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && "
                "break; sleep 0.1; done",
            ]
        elif cmd.endswith("&"):  # `kvfleet cluster up ... &`: wait for its kubeconfig
            kubeconfig = re.search(r"--kubeconfig (\S+)", cmd)
            assert kubeconfig, cmd
            out += [
                cmd,
                'PIDS="$PIDS $!"',
                # As a user waits for it: ~40 s on a quiet machine, 95-112 s measured at load 11
                # (applying the CRDs took 60-90 s of it there).
                f"for i in $(seq 1800); do [ -s {kubeconfig.group(1)} ] && break; sleep 0.1; done",
                f"[ -s {kubeconfig.group(1)} ] || {{ echo '::: FAILED (no kubeconfig)'; exit 1; }}",
            ]
        else:
            out.append(f'{cmd} || {{ echo "::: FAILED (exit $?)"; exit 1; }}')
    return "\n".join(out) + "\n"


def _end_group(leader: subprocess.Popen[str], grace_s: float = 15.0) -> None:
    """SIGTERM to every process of the leader's group (a cluster stops its pods), SIGKILL to
    what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            leader.poll()  # reaped: a zombie leader would keep the group alive
            os.killpg(leader.pid, 0)  # ProcessLookupError once the group is empty
            time.sleep(0.2)
        os.killpg(leader.pid, signal.SIGKILL)


def run_commands(commands: list[str], tmp: Path, timeout_s: float = 300) -> str:
    """Run `commands` in one bash, in a scratch copy of what the README refers to."""
    work = tmp / "work"
    if not work.exists():
        work.mkdir()
        for d in ("manifests", "crds", "examples", "charts", "tests/data"):
            shutil.copytree(ROOT / d, work / d, symlinks=True)
    # Go too: `kvfleet cluster up` finds the control plane it built by Go's version, in the
    # user's cache (a fresh HOME here, so the cache is named).
    tools = (sys.executable, kubectl_binary(), dev_binary("helm"), require_binary("go"))
    bins = dict.fromkeys(str(Path(t).parent) for t in tools)
    env = {
        "PATH": ":".join([*bins, "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": str(tmp),
        "LANG": "C.UTF-8",
        "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"),
    }
    script = _script(commands, tmp)
    # A session of its own: on a timeout the whole group goes, background jobs too (the
    # script's own trap does not run when bash is killed; a `kvfleet cluster up &` outlived
    # a timed-out walkthrough and held its pods' ports for the rest of the suite).
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout_s:.0f} s:\n{out[-6000:]}")
    assert proc.returncode == 0 and "::: FAILED" not in out, out[-6000:]
    return out


def test_every_readme_command_is_run_here_or_names_its_test() -> None:
    ran = {
        cmd
        for heading in ("The simulator", "The gateway", "Installing on a cluster", "The admin CLI",
                        "The autoscaler", "The local cluster", "Many models behind one gateway")
        for cmd in block(heading)
    } | {cmd for cmd in _helm_block()}  # fmt: skip
    print(
        "README commands run elsewhere:",
        *(f"  {c}: {w}" for c, w in RUN_ELSEWHERE.items()),
        "changed before they run:",
        *(f"  {c}: {w}" for c, w in CHANGED.items()),
        sep="\n",
    )
    for heading, commands in readme_blocks():
        for cmd in commands:
            assert cmd in ran or cmd in RUN_ELSEWHERE, f"{heading}: {cmd!r} is run by no test"


def _helm_block() -> list[str]:
    return next(c for h, c in readme_blocks() if c and c[0].startswith("helm install"))


def test_the_simulator_and_gateway_walkthrough(tmp_path: Path) -> None:
    commands = [c for c in block("The simulator") + block("The gateway") if c not in RUN_ELSEWHERE]
    out = run_commands(commands, tmp_path)
    assert "simulated" in out  # sim offline labels its times
    assert "sha256:" in (tmp_path / "work" / "keys.yaml").read_text()


# The longest story of the suite (five README sections, some 70 commands, one cluster): 60-90 s
# alone, 150-180 s in `make test` on two cores. The every-example story
# (test_operator_in_cluster.py) runs on a worker of its own (`make test` distributes by
# group). Its commands are bounded by run_commands' own timeout; this is the backstop.
@pytest.mark.xdist_group("whole-cluster")
@pytest.mark.timeout(360)
def test_the_cluster_walkthroughs_on_the_local_cluster(tmp_path: Path) -> None:
    require_binary("redis-server")  # examples/redis.yaml, which the autoscaled example needs
    local = block("The local cluster")
    up, export, rest = local[0], local[1], local[2:]
    kubeconfig = str(tmp_path / "kvfleet.kubeconfig")
    (written,) = CHANGED
    up, export = (c.replace(written, kubeconfig) for c in (up, export))
    commands = [
        up, export,
        *block("Installing on a cluster"), *block("Many models behind one gateway"),
        *block("The admin CLI"), *block("The autoscaler"), *rest,
    ]  # fmt: skip
    out = run_commands(commands, tmp_path)
    assert '"completion_tokens"' in out, out[-3000:]  # the curl through mistral's gateway pod
    # examples/openai_client.py through `kubectl port-forward svc/mistral`, streamed.
    assert re.search(r"\[\d+ prompt, \d+ completion\]", out), out[-3000:]
    assert "desiredActive" in out  # the autoscaler's decision, read with jsonpath


def test_the_helm_install_on_a_fresh_local_cluster(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    commands = [
        f"kvfleet cluster up --no-processes --kubeconfig {kubeconfig} &",
        f"export KUBECONFIG={kubeconfig}",
        *_helm_block(),
        "helm status kvfleet --namespace kvfleet-system",
        "kubectl wait --for=condition=Established crd/inferenceservices.kvfleet.dev",
    ]
    out = run_commands(commands, tmp_path)
    assert "STATUS: deployed" in out and "successfully rolled out" in out
    # The chart is self-contained: not a word about symbolic links (it printed six).
    assert "symbolic link" not in out, out
