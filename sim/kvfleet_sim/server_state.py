"""The simulated SGLang server's configuration and per-app state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from kvfleet_sim.config import EngineConfig
from kvfleet_sim.costmodel import DEFAULT_PROFILE
from kvfleet_sim.disaggregation import DisaggConfig, Rooms
from kvfleet_sim.engine import Engine
from kvfleet_sim.faults import FaultPlan, FaultState
from kvfleet_sim.kv_events import KvEventsConfig, ZmqKvEventPublisher
from kvfleet_sim.lora import LoraConfig, Registry
from kvfleet_sim.measured import DEFAULT_TRUTH
from kvfleet_sim.metrics import EngineMetrics
from kvfleet_sim.multinode import DistConfig, Rendezvous
from kvfleet_sim.realtime import RealtimeRunner

SGLANG_VERSION = "0.5.23"  # the release whose protocol this server reproduces


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    served_model_name: str
    """`--served-model-name`; defaults to the model path."""
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    time_scale: float = 1.0
    """Wall seconds per simulated GPU second (0.1 runs ten times faster than the GPU would)."""
    startup_delay_s: float = 0.0
    """Simulated model load: /health answers 503 for this long after start."""
    stream_interval: int = 1
    """`--stream-interval`: tokens per streamed chunk after the first."""
    api_key: str | None = None
    profile: str = DEFAULT_PROFILE
    truth: str = DEFAULT_TRUTH
    """`--cost-model`: measured GPU timings where profiled, else the roofline (`auto`)."""
    simulate_eos: bool = True
    """Requests without ignore_eos end naturally at a seeded, ShareGPT-like length."""
    faults: FaultPlan = field(default_factory=FaultPlan)
    kv_events: KvEventsConfig | None = None
    """`--kv-events-config`: publish the radix cache's events like SGLang."""
    tokenizer_path: str | None = None
    """`--tokenizer-path`: a Hugging Face tokenizer.json directory (None: the stand-in)."""
    dist: DistConfig = field(default_factory=DistConfig)
    """`--nnodes`, `--node-rank`, `--dist-init-addr`: this is rank 0 of a multi-node engine."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    """`--disaggregation-*`: a prefill or a decode server of a disaggregated service."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """`--enable-lora`, `--lora-paths`, ...: LoRA adapters (the engine config's
    max_loras_per_batch is set from it)."""


@dataclass
class SimState:
    config: ServerConfig
    engine: Engine
    runner: RealtimeRunner
    metrics: EngineMetrics
    faults: FaultState
    started: float = field(default_factory=time.monotonic)
    rendezvous: Rendezvous | None = None
    """Multi-node: the other ranks joining; nothing is served until all have."""
    rooms: Rooms = field(default_factory=Rooms)
    """Prefill mode: the KV hand-offs offered to decode servers."""
    pending_rooms: dict[str, int] = field(default_factory=dict)
    """Prefill mode: request id → its room, until its first token."""
    adapters: Registry = field(default_factory=lambda: Registry(LoraConfig()))
    """The LoRA adapters loaded (make_app builds it from the config)."""

    @property
    def loaded(self) -> bool:
        if self.rendezvous is not None and not self.rendezvous.complete:
            return False
        return time.monotonic() - self.started >= self.config.startup_delay_s


STATE = web.AppKey("kvfleet_sim_state", SimState)
PUBLISHER = web.AppKey("kvfleet_sim_kv_events", ZmqKvEventPublisher)


def state_of(request: web.Request) -> SimState:
    return request.app[STATE]
