"""The hostile-tenant and hostile-spec vectors of issue 55, each fired once at the real thing
with what it measures: a section of `kvfleet bench reliability`'s report, and on their own
(printed, or written where `--out` says) `kvfleet bench hostile-fields`.

Gateway vectors go over HTTP with a valid key to a `kvfleet gateway` process (memory limits
store) in front of one LoRA-enabled simulator process; the figures are read where they show:
the engine's own counters (`/metrics` of the simulator), the tenant's budget gauge (the
gateway's metrics port), the bytes a client sent. The negative price is the gateway's config
parser run as a process; the spec vectors are the operator's spec parser.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_bench.spec_cost import largest_lora_spec, time_parse
from kvfleet_gateway.keys import hash_key
from kvfleet_kernel.schema import ConfigError
from kvfleet_operator.render.engine import engine_args
from kvfleet_operator.spec import parse_spec
from kvfleet_sim.procs import free_port, running_process

MODEL = "llama-3.1-8b"
KEY, LIMITED = "kvf-fields-tenant", "kvf-fields-base-only"
BUDGET = 10_000_000
ADAPTERS = ("sql", "chat", "code", "math")
LOAD_CHARGE = 100
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}


@dataclass(frozen=True)
class Vector:
    name: str
    sent: str
    answer: str
    figure: str
    held: bool


def _config(work: Path, engine: str, port: int, metrics: int) -> Path:
    tenants = [{"name": "t", "keys": [hash_key(KEY)],
                "limits": {"tokenBudget": {"tokens": BUDGET, "period": "1d"}}},
               {"name": "base", "keys": [hash_key(LIMITED)],
                "limits": {"models": [MODEL]}}]  # fmt: skip
    keys = work / "keys.yaml"
    keys.write_text(json.dumps({"tenants": tenants}))
    lora = {"adapters": [{"name": n, "path": f"/adapters/{n}"} for n in ADAPTERS],
            "maxAdaptersPerReplica": 2, "tenantLoadsPerMinute": 2,
            "loadChargeTokens": LOAD_CHARGE}  # fmt: skip
    doc = {
        "listen": {"host": "127.0.0.1", "port": port, "metricsPort": metrics},
        "backends": {"static": [engine]},
        "auth": {"keysFile": str(keys)},
        "limits": {"store": "memory"},
        "requests": {"allow": ["lora_path"]},
        "lora": lora,
        "healthInterval": "0.5s",
        "accessLog": False,
    }
    path = work / "gateway.yaml"
    path.write_text(json.dumps(doc))
    return path


async def _metric(s: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """The sum of every sample of `name` in a Prometheus text page; None: no sample yet."""
    async with s.get(url) as r:
        text = await r.text()
    samples = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {"]  # fmt: skip
    return sum(samples) if samples else None


class Target:
    """The gateway, the engine's counters and the tenant's budget, from one session."""

    def __init__(self, s: aiohttp.ClientSession, gw: str, engine: str, metrics: str) -> None:
        self.s, self.gw, self.engine, self.metrics = s, gw, engine, metrics

    async def post(self, body: Any, path: str = "/v1/chat/completions",
                   key: str = KEY) -> tuple[int, dict[str, Any], int]:  # fmt: skip
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with self.s.post(f"{self.gw}{path}", data=data, headers=headers) as r:
            return r.status, json.loads(await r.read() or b"{}"), len(data)

    async def engine_tokens(self, kind: str) -> float:
        found = await _metric(self.s, f"{self.engine}/metrics", f"sglang:{kind}_tokens_total")
        return found or 0.0

    async def billed(self) -> float:
        """Tokens spent from the tenant's budget (no gauge yet: nothing settled)."""
        left = await _metric(self.s, self.metrics, "kvfleet_gateway_budget_remaining_tokens")
        return 0.0 if left is None else BUDGET - left


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}], **extra}  # fmt: skip


def _answer(status: int, body: dict[str, Any]) -> str:
    error = body.get("error") or {}
    param = error.get("param") or error.get("code")
    return f"{status}" + (f" ({param})" if param else "")


async def _template(t: Target) -> Vector:
    before = await t.engine_tokens("prompt")
    loop = "{% for i in range(20000) %}hello world {% endfor %}"
    status, body, _ = await t.post(chat(chat_template_kwargs={"chat_template": loop}))
    prefilled = await t.engine_tokens("prompt") - before
    return Vector("chat_template_kwargs.chat_template", "a 20,000-iteration Jinja loop",
                  _answer(status, body), f"engine prompt tokens: {prefilled:.0f}",
                  status == 400 and prefilled == 0)  # fmt: skip


async def _logprobs(t: Target) -> list[Vector]:
    cases = [("chat top_logprobs \"100000\"", chat(logprobs=True, top_logprobs="100000")),
             ("chat top_logprobs 1e5", '{"model": "%s", "max_tokens": 4, "logprobs": true, '
              '"top_logprobs": 1e5, "messages": [{"role": "user", "content": "hi"}]}'
              .replace("%s", MODEL))]  # fmt: skip
    out = []
    for name, body in cases:
        status, reply, _ = await t.post(body)
        out.append(Vector(name, "alternatives per token", _answer(status, reply),
                          f"status {status}", status == 400))  # fmt: skip
    completions = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": "100000"}
    status, reply, _ = await t.post(completions, "/v1/completions")
    out.append(Vector("completions logprobs \"100000\"", "alternatives per token",
                      _answer(status, reply), f"status {status}", status == 400))  # fmt: skip
    return out


async def _grammars(t: Target) -> list[Vector]:
    cases = [("response_format json_schema + stray schema",
              {"type": "json_schema", "json_schema": {}, "schema": BIG_SCHEMA}),
             ("response_format structural_tag", {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": BIG_SCHEMA, "end": "</f>"}]})]  # fmt: skip
    out = []
    for name, fmt in cases:
        status, reply, sent = await t.post(chat(response_format=fmt))
        out.append(Vector(name, "a 3,000-property JSON schema", _answer(status, reply),
                          f"{sent:,} bytes sent", status == 400))  # fmt: skip
    return out


async def _token_ids_and_lora_path(t: Target) -> list[Vector]:
    status, reply, _ = await t.post(chat(input_ids=[-5, 10**12]))
    ids = Vector("chat input_ids out of vocabulary", "[-5, 10**12]", _answer(status, reply),
                 f"status {status}", status == 400)  # fmt: skip
    status, reply, _ = await t.post(chat(lora_path="sql"), key=LIMITED)
    path = Vector("lora_path past the model allow-list", 'lora_path "sql", tenant allowed '
                  "the base model only", _answer(status, reply), f"status {status}",
                  status == 403)  # fmt: skip
    return [ids, path]


async def _churn(t: Target) -> Vector:
    """Cycle the four adapters (two fit a replica): loads caused, refused, charged."""
    statuses: list[int] = []
    used = 0.0
    before = await t.billed()
    for i in range(8):
        status, body, _ = await t.post({**chat(), "model": ADAPTERS[i % 4]})
        statuses.append(status)
        used += (body.get("usage") or {}).get("total_tokens", 0)
    charged = await t.billed() - before - used
    loads = round(charged / LOAD_CHARGE)
    refused = statuses.count(429)
    return Vector("adapter churn", "8 requests cycling 4 adapters (2 per replica)",
                  f"statuses {statuses}", f"{loads} loads charged ({charged:.0f} tokens), "
                  f"{refused} refused (adapter_loads_exceeded)",
                  loads <= 2 and refused > 0)  # fmt: skip


def _reset_mid_stream(host: str, port: int) -> None:
    """A raw client that asks for a long stream, reads one chunk, stops reading, then resets."""
    body = json.dumps(chat(max_tokens=2000, stream=True)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(head.encode() + body)
    sock.recv(1024)
    time.sleep(1.0)  # not reading: the gateway's writes back up
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # an RST, not a FIN


async def _slow_reader(t: Target, port: int) -> Vector:
    billed = await t.billed()
    prompt, out = await t.engine_tokens("prompt"), await t.engine_tokens("generation")
    await asyncio.to_thread(_reset_mid_stream, "127.0.0.1", port)
    await asyncio.sleep(2.0)  # the gateway settles after its drain of the engine's usage
    billed = await t.billed() - billed
    engine = (await t.engine_tokens("prompt") - prompt
              + await t.engine_tokens("generation") - out)  # fmt: skip
    return Vector("slow reader, reset mid-stream", "max_tokens 2000 streamed, 1 s unread, RST",
                  "stream cut", f"billed {billed:.0f} of the engine's {engine:.0f} tokens",
                  engine > 0 and billed >= engine)  # fmt: skip


def _negative_price(work: Path) -> Vector:
    doc = {"listen": {"port": free_port()}, "backends": {"static": ["http://127.0.0.1:1"]},
           "auth": {"insecureNoAuth": True},
           "models": [{"name": MODEL,
                       "price": {"prompt": 1, "output": 1, "cached": -1e6}}]}  # fmt: skip
    path = work / "negative-price.yaml"
    path.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "-m", "kvfleet_cli", "gateway", "--config", str(path)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    lines = (done.stderr or done.stdout).strip().splitlines() or [""]
    error = lines[-1].replace(str(path), path.name)
    return Vector("negative price (gateway config)", "models[0].price.cached: -1e6",
                  f"`{error}`", f"exit code {done.returncode}",
                  done.returncode != 0 and "minimum" in lines[-1])  # fmt: skip


def _spec_vectors() -> list[Vector]:
    base: dict[str, Any] = {"model": {"name": "llama", "source": {"huggingFace": "org/l"}},
                            "gateway": {"apiKeysSecret": "keys"}}  # fmt: skip
    lora: dict[str, Any] = {"maxLoraRank": 16, "adapters": []}
    cases: list[tuple[str, str, dict[str, Any]]]
    cases = [("targetModules flag injection", '["q_proj", "--enable-custom-logit-processor"]',
              {"lora": {**lora, "targetModules": ["q_proj", "--enable-custom-logit-processor"]}}),
             ("env override", "engine.env KVFLEET_ENGINE_API_KEY",
              {"engine": {"env": [{"name": "KVFLEET_ENGINE_API_KEY", "value": "x"}]}}),
             ("pvc path out of its claim", 'model.source.pvc.path "../../etc"',
              {"model": {"name": "llama",
                         "source": {"pvc": {"claimName": "w", "path": "../../etc"}}}})]  # fmt: skip
    out = []
    for name, sent, extra in cases:
        try:
            parse_spec({**base, **extra})
            answer, held = "accepted", False
        except ConfigError as error:
            answer, held = f"refused at {error.path}", True
        out.append(Vector(name, sent, answer, "refused" if held else "accepted", held))
    out.append(_expansion(base))
    seconds = time_parse(largest_lora_spec(), 5)
    out.append(Vector("largest spec (CRD maximum sizes)", "every list and string at its bound",
                      "parsed", f"{seconds * 1000:.1f} ms", seconds < 0.1))  # fmt: skip
    return out


def _expansion(base: dict[str, Any]) -> Vector:
    parsed = parse_spec({**base, "engine": {"extraArgs": ["--chat-template=$(SECRET)"]}})
    args = [a for a in engine_args(parsed) if a.startswith("--chat-template")]
    held = args == ["--chat-template=$$(SECRET)"]
    return Vector("$(VAR) expansion", "extraArgs --chat-template=$(SECRET)",
                  f"rendered `{args[0] if args else ''}`", "escaped" if held else "expanded",
                  held)  # fmt: skip


async def _gateway_vectors(work: Path) -> list[Vector]:
    port, engine_port, metrics = free_port(), free_port(), free_port()
    gw, engine = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
    sim = [sys.executable, "-m", "kvfleet_sim", "serve", "--model", MODEL, "--gpu", "h100",
           "--port", str(engine_port), "--time-scale", "0.02", "--enable-lora",
           "--lora-paths", "sql=/adapters/sql", "--max-loras-per-batch", "2"]  # fmt: skip
    gateway = [sys.executable, "-m", "kvfleet_cli", "gateway",
               "--config", str(_config(work, engine, port, metrics))]  # fmt: skip
    with ExitStack() as stack:
        stack.enter_context(running_process(sim, f"{engine}/health", work / "sim.log"))
        stack.enter_context(running_process(gateway, f"{gw}/readyz", work / "gateway.log"))
        async with aiohttp.ClientSession() as s:
            t = Target(s, gw, engine, f"http://127.0.0.1:{metrics}/metrics")
            out = [await _template(t), *await _logprobs(t), *await _grammars(t)]
            out += [*await _token_ids_and_lora_path(t), await _churn(t)]
            out.append(await _slow_reader(t, port))
    return out


def run_hostile_fields(work: Path, echo: Callable[[str], None]) -> list[Vector]:
    """Every vector, gateway then config then spec, each echoed as it is measured."""
    vectors = asyncio.run(_gateway_vectors(work))
    vectors += [_negative_price(work), *_spec_vectors()]
    for v in vectors:
        echo(f"{v.name}: {v.answer}; {v.figure}; {'held' if v.held else 'NOT HELD'}")
    return vectors


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report(vectors: list[Vector], seconds: float) -> str:
    """The markdown table, one row per vector."""
    rows = [f"| {_cell(v.name)} | {_cell(v.sent)} | {_cell(v.answer)} | {_cell(v.figure)} | "
            f"{'yes' if v.held else '**no**'} |" for v in vectors]  # fmt: skip
    held = sum(v.held for v in vectors)
    return "\n".join([
        "## Hostile fields and specs (`kvfleet bench reliability`; alone: `kvfleet bench "
        "hostile-fields`)",
        "",
        "Issue 55's vectors, each sent once with a valid key to a `kvfleet gateway` process "
        "over one simulated engine (LoRA on, 4 adapters, 2 per replica), or given to the "
        "gateway's config parser or the operator's spec parser; the figure is read from the "
        f"engine's counters or the tenant's budget. {held} of {len(vectors)} held; run "
        f"{seconds:.1f} s.",
        "",
        "| vector | sent | answer | figure | held |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])  # fmt: skip


def as_json(vectors: list[Vector]) -> dict[str, Any]:
    return {"vectors": [asdict(v) for v in vectors], "held": all(v.held for v in vectors)}
