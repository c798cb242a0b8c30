"""The node agent's own parts: SGLang's command line as the simulator's, mounts as paths,
pod addresses, preStop sleeps, and its loops ending when cancelled."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kvfleet_localcluster.containers import container_argv, sglang_to_sim
from kvfleet_localcluster.kubelet import KubeletConfig, substitute


def test_sglang_flags_map_to_the_simulator_and_unknown_ones_are_reported() -> None:
    flags, dropped = sglang_to_sim(
        [
            "--model-path",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
            "--enable-metrics",
            "--tp-size",
            "2",
            "--schedule-policy",
            "lof",
            "--quantization=fp8",
            "--trust-remote-code",
            "--revision",
            "main",
            "--disable-radix-cache",
        ]
    )
    assert flags == [
        "--model-path",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--port",
        "30000",
        "--enable-metrics",
        "--tp-size",
        "2",
        "--quantization",
        "fp8",
        "--disable-radix-cache",
    ]
    assert dropped == ["--schedule-policy lof", "--trust-remote-code", "--revision main"]


def test_engine_container_becomes_a_simulator_on_the_pod_ip() -> None:
    container = {
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "m/x", "--host", "0.0.0.0", "--port", "30000"],
    }
    argv, notes = container_argv(container, "127.0.0.7", "NVIDIA-H200", KubeletConfig()) or ([], [])
    i = argv.index("serve")
    assert argv[i + 1 :][:4] == ["--model-path", "m/x", "--port", "30000"]
    assert argv[argv.index("--host") + 1] == "127.0.0.7"
    assert argv[argv.index("--gpu") + 1] == "NVIDIA-H200"
    assert notes == []
    gateway = container_argv(
        {"command": ["kvfleet"], "args": ["gateway", "--config", "/c/g.yaml"]},
        "127.0.0.9",
        "h100",
        KubeletConfig(),
    )
    # The kvfleet image's command runs as written: its wildcard listener lands on the pod's
    # address through the pod shim, as it would in the pod's own network namespace.
    assert gateway is not None and gateway[0][-3:] == ["gateway", "--config", "/c/g.yaml"]
    assert container_argv({"image": "nginx"}, "127.0.0.3", "h100", KubeletConfig()) is None


def test_mount_paths_are_substituted_once_at_path_boundaries() -> None:
    mounts = {"/tmp": Path("/var/k/pod/tmp"), "/etc/kvfleet/config/": Path("/var/k/pod/config")}
    assert (
        substitute("/etc/kvfleet/config/gateway.yaml", mounts) == "/var/k/pod/config/gateway.yaml"
    )
    assert (
        substitute("keysFile: /tmp/k.yaml\nx: /tmpfile", mounts)
        == "keysFile: /var/k/pod/tmp/k.yaml\nx: /tmpfile"
    )


def test_mounts_rewrite_the_containers_arguments_not_the_local_interpreter() -> None:
    import sys

    top = "/" + sys.executable.split("/")[1]  # a mount over the interpreter's own top directory
    container = {"command": ["kvfleet"], "args": ["gateway", "--config", f"{top}/cfg/g.yaml"]}
    argv, _ = container_argv(
        container, "127.0.0.9", "h100", KubeletConfig(), {top: Path("/pod/v")}
    ) or ([], [])
    assert argv[0] == sys.executable
    assert argv[argv.index("--config") + 1] == "/pod/v/cfg/g.yaml"


def test_two_local_clusters_at_once_get_their_own_pod_addresses() -> None:
    """Each running cluster claims its own loopback /16, as a node is given its own pod
    CIDR: two clusters' pods never share an address (and so never a port)."""
    from kvfleet_localcluster.addresses import PodRange

    first, second = PodRange(), PodRange()
    try:
        assert first.octet != second.octet
        assert first.address(1).startswith(f"127.{first.octet}.0.")
        assert {first.address(n) for n in range(1, 600)}.isdisjoint(
            second.address(n) for n in range(1, 600)
        )
        assert len({first.address(n) for n in range(1, 600)}) == 599
    finally:
        taken = first.octet
        first.release()
        second.release()
    again = PodRange()
    try:
        assert again.octet <= taken  # a released range is claimed again
    finally:
        again.release()


def test_sglangs_list_flags_become_the_simulators_repeated_ones() -> None:
    """--lora-paths a=x b=y (several values after one flag, as SGLang parses them) →
    --lora-paths a=x --lora-paths b=y; the flag after them is read as usual."""
    flags, dropped = sglang_to_sim(
        ["--enable-lora", "--lora-paths", "sql=acme/sql", "chat=/lora/c", "--max-loras-per-batch",
         "4", "--lora-target-modules", "q_proj", "v_proj"]
    )  # fmt: skip
    assert flags == [
        "--enable-lora", "--lora-paths", "sql=acme/sql", "--lora-paths", "chat=/lora/c",
        "--max-loras-per-batch", "4", "--lora-target-modules", "q_proj",
        "--lora-target-modules", "v_proj",
    ]  # fmt: skip
    assert dropped == []


class IdleApi:
    """An API server with nothing to say: the node registers, then its watches wait."""

    async def create(self, *args: Any, **kw: Any) -> dict[str, Any]:
        return {}

    async def patch(self, *args: Any, **kw: Any) -> dict[str, Any]:
        return {}

    async def get(self, *args: Any, **kw: Any) -> dict[str, Any]:
        return {"metadata": {"uid": "node-uid"}}

    async def list(self, *args: Any, **kw: Any) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}, "items": []}

    async def watch(self, *args: Any, **kw: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        import asyncio

        await asyncio.Event().wait()
        yield "ADDED", {}  # never reached: a watch that stays open


async def test_the_node_agent_stops_when_cancelled_as_its_pods_change(tmp_path: Path) -> None:
    """A cancel that lands in the same turn as a change of the node's pods ends the node
    agent's loop (with `asyncio.wait_for` on Python 3.11 it was lost: the loop went on, and a
    cluster's teardown waited for it until the test's timeout)."""
    import asyncio

    from kvfleet_localcluster.node_agent import NodeAgent, NodeSpec

    kubelet = KubeletConfig(run_processes=False, state_dir=tmp_path)
    agent = NodeAgent(
        NodeSpec("node-1"), IdleApi(), kubelet,  # type: ignore[arg-type]
        lambda: "127.0.0.2", "127.0.0.1", 6443, b"",
    )  # fmt: skip
    task = asyncio.create_task(agent.run())
    for _ in range(10):  # registered, listed, and into its wait for a change
        await asyncio.sleep(0)
    assert agent.pods.synced.is_set() and not task.done()
    agent._dirty.set()  # a change (its pods' watch sets it) ...
    task.cancel()  # ... and the cluster stopping, at once
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert task in done and task.cancelled(), "the node agent went on after a cancel"


def test_the_kubeconfig_is_written_whole_and_private(tmp_path: Path) -> None:
    """`kvfleet cluster up ... &` and a script waiting for the kubeconfig: it appears whole
    (a rename), readable by its owner only (it holds an admin token), with no scrap left."""
    from kvfleet_localcluster.files import replace_file

    path = tmp_path / "kube" / "config"
    replace_file(path, "apiVersion: v1\n", mode=0o600)
    replace_file(path, "apiVersion: v1\nkind: Config\n", mode=0o600)  # replaced, not appended
    assert path.read_text() == "apiVersion: v1\nkind: Config\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["config"]


def test_which_pre_stop_hooks_are_sleeps() -> None:
    from kvfleet_localcluster.kubelet import pre_stop_sleep

    assert pre_stop_sleep({"exec": {"command": ["sleep", "10"]}}) == 10
    assert pre_stop_sleep({"exec": {"command": ["/bin/sh", "-c", "sleep 2.5"]}}) == 2.5
    assert pre_stop_sleep({"sleep": {"seconds": 5}}) == 5
    assert pre_stop_sleep({"exec": {"command": ["nginx", "-s", "quit"]}}) is None
    assert pre_stop_sleep({"httpGet": {"path": "/drain", "port": 80}}) is None


async def test_a_swallowed_cancel_is_repeated_until_the_task_ends() -> None:
    """A task that turns its first cancel into a failed probe and goes on (as a cancel landing
    on a timeout does) still ends: the kubelet cancels again rather than wait forever."""
    import asyncio

    from kvfleet_localcluster.kubelet import cancel_and_wait

    cancels = 0

    async def probe_loop() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels == 1:
                    continue  # swallowed, as a TimeoutError would be
                raise

    task = asyncio.create_task(probe_loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), timeout=10)
    assert task.cancelled() and cancels == 2
