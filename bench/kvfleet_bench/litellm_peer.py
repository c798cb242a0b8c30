"""LiteLLM's proxy as a peer to measure the gateway against: the real `litellm` server, from
its own virtualenv (`make bench` builds `.venv-litellm` with a pinned release: its dependency
tree is large and pins its own versions, so it stays out of kvfleet's), in front of the same
engines as the others.

How it is run, so that it measures the proxy and not this machine's missing network:
- one deployment per engine under one model name (LiteLLM's router spreads requests over
  them, its default `simple-shuffle`), the engines' OpenAI API as `openai/<model>`;
- a master key (LiteLLM refuses to start without one) presented by the clients: a string
  comparison per request, as kvfleet's key check is a hash and a comparison;
- `HF_HUB_OFFLINE=1` and the bundled model-cost map: with no network, LiteLLM's token counting
  would otherwise retry a Hugging Face tokenizer download for seconds on the first stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from kvfleet_sim.procs import free_port, running_process

LITELLM_VERSION = "1.108.7"
"""The release `make bench` installs (the Makefile pins the same one)."""
MASTER_KEY = "sk-kvfleet-bench-0123456789abcdef0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {MASTER_KEY}"}
MODEL = "llama-3.1-8b"


def litellm_config(engines: list[str]) -> dict[str, object]:
    """LiteLLM's proxy config: one deployment per engine, telemetry off."""
    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"{url}/v1",
                    "api_key": "none",
                },
            }
            for url in engines
        ],
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }


@contextlib.contextmanager
def litellm_process(
    binary: Path,
    engines: list[str],
    work: Path,
    on_started: Callable[[int], None] | None = None,
    timeout: float = 90.0,
) -> Iterator[str]:
    """The LiteLLM proxy serving on a free loopback port until the block ends."""
    config = work / "litellm.yaml"
    config.write_text(yaml.safe_dump(litellm_config(engines)))
    port = free_port()
    argv = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    env = {
        "LITELLM_MASTER_KEY": MASTER_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "HF_HUB_OFFLINE": "1",
        "LITELLM_LOG": "ERROR",
    }
    url = f"http://127.0.0.1:{port}"
    with running_process(
        argv,
        ready_url=f"{url}/health/liveliness",
        log_path=work / "litellm.log",
        timeout=timeout,
        env=env,
    ) as proc:
        if on_started is not None:
            on_started(proc.pid)
        yield url
