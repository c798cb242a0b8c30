"""What process a container becomes on the local node: an SGLang server
(`python3 -m sglang.launch_server FLAGS`) runs as the simulator with the flags it models (the
others dropped and listed in the pod's log), the kvfleet image's `kvfleet ...` as itself, the
official Redis image as the local `redis-server` bound to the pod's address, and any Python
script with this Python. Other images run no process."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfleet_localcluster.podspec import substitute

if TYPE_CHECKING:  # the kubelet's config (the kubelet imports this module)
    from kvfleet_localcluster.kubelet import KubeletConfig

Json = dict[str, Any]
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_GPU = "h100"
SGLANG_COMMAND = ("-m", "sglang.launch_server")
# Flags of `kvfleet sim serve` that mean what SGLang's mean: flag → takes a value.
SIM_FLAGS: dict[str, bool] = {
    "--model-path": True,
    "--model": True,
    "--served-model-name": True,
    "--port": True,
    "--tp-size": True,
    "--tp": True,
    "--mem-fraction-static": True,
    "--context-length": True,
    "--max-running-requests": True,
    "--max-total-tokens": True,
    "--max-queued-requests": True,
    "--chunked-prefill-size": True,
    "--max-prefill-tokens": True,
    "--page-size": True,
    "--kv-cache-dtype": True,
    "--api-key": True,
    "--disable-radix-cache": False,
    "--enable-metrics": False,
    "--quantization": True,
    "--schedule-policy": True,
    "--kv-events-config": True,
    "--tokenizer-path": True,
    "--nnodes": True,
    "--node-rank": True,
    "--dist-init-addr": True,
    "--disaggregation-mode": True,
    "--disaggregation-transfer-backend": True,
    "--disaggregation-bootstrap-port": True,
    "--disaggregation-ib-device": True,
    "--enable-lora": False,
    "--max-loras-per-batch": True,
    "--max-lora-rank": True,
    "--max-loaded-loras": True,
}
SIM_LISTS = ("--lora-paths", "--lora-target-modules")
"""SGLang flags taking several values after one flag; the simulator repeats the flag."""
SIM_VALUES = {"--quantization": {"none", "fp8"}, "--schedule-policy": {"fcfs", "lpm"}}


def gpu_of(pod_spec: Json) -> str:
    return (pod_spec.get("nodeSelector") or {}).get(GPU_PRODUCT_LABEL) or DEFAULT_GPU


def sglang_to_sim(args: list[str]) -> tuple[list[str], list[str]]:
    """SGLang server flags → `kvfleet sim serve` flags, and the flags dropped."""
    out: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in SIM_LISTS:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                out += [arg, args[j]]
                j += 1
            i = j
            continue
        flag, _, inline = arg.partition("=")
        takes = SIM_FLAGS.get(flag)
        has_next = i + 1 < len(args) and not args[i + 1].startswith("--")
        value = inline or (args[i + 1] if has_next and not inline else "")
        step = 2 if (has_next and not inline and takes is not False) else 1
        if flag == "--host":
            step = 2 if has_next else 1
        elif takes is None or (flag in SIM_VALUES and value not in SIM_VALUES[flag]):
            dropped.append(" ".join(args[i : i + step]))
        else:
            out += [flag, value] if takes else [flag]
        i += step
    return out, dropped


def container_argv(
    container: Json,
    pod_ip: str,
    gpu: str,
    config: KubeletConfig,
    mounts: dict[str, Path] | None = None,
) -> tuple[list[str], list[str]] | None:
    """The local command for a container, and the notes for its log (None: no process).
    Mount paths in the container's own command line become their local directories."""
    command = [
        substitute(str(a), mounts or {})
        for a in [*(container.get("command") or []), *(container.get("args") or [])]
    ]
    if (
        len(command) >= 3
        and Path(command[0]).name.startswith("python")
        and tuple(command[1:3]) == SGLANG_COMMAND
    ):
        flags, dropped = sglang_to_sim(command[3:])
        argv = [
            *config.engine_command,
            "serve",
            *flags,
            "--host",
            pod_ip,
            "--gpu",
            gpu,
            "--time-scale",
            str(config.engine_time_scale),
            "--startup-delay",
            str(config.engine_startup_delay_s),
        ]
        notes = [f"kubelet: dropped flags the simulator does not model: {d}" for d in dropped]
        return argv, notes
    image = str(container.get("image", "")).rsplit("/", 1)[-1].split(":")[0].split("@")[0]
    if image == "redis" and config.redis_server:
        # The official image runs `redis-server ARGS` (args alone are its flags); bound to
        # the pod's address, as redis binds in C, where the pod shim does not reach.
        if command and Path(command[0]).name == "redis-server":
            command = command[1:]
        if not command or command[0].startswith("-"):
            return [config.redis_server, *command, "--bind", pod_ip], []
    if command and Path(command[0]).name == "kvfleet":
        return [*config.kvfleet_command, *command[1:]], []
    if command and re.fullmatch(r"python(3(\.\d+)?)?", Path(command[0]).name):
        return [sys.executable, *command[1:]], []  # the image's Python runs any script
    return None


TERMINATION_LOG_LINES, TERMINATION_LOG_BYTES = 80, 2048
"""What a kubelet takes of a failed container's log under FallbackToLogsOnError: its last
80 lines, at most 2 KiB (the kubelet's own bounds)."""


def termination_message(container: Json, log_path: Path, exit_code: int) -> str:
    """The message a kubelet puts in `lastState.terminated.message`. The container's
    terminationMessagePath cannot be written here (no mount namespace: /dev/termination-log
    is the node's), so the message is what FallbackToLogsOnError gives a container that
    failed and wrote none: its log's tail. Under the default policy (File) it is empty."""
    if exit_code == 0 or container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        text = log_path.read_bytes()[-TERMINATION_LOG_BYTES * 4 :].decode(errors="replace")
    except OSError:
        return ""
    tail = "\n".join(text.splitlines()[-TERMINATION_LOG_LINES:])
    return tail.encode()[-TERMINATION_LOG_BYTES:].decode(errors="ignore")
