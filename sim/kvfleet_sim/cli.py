"""`kvfleet sim ...`: the SGLang-compatible simulator."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import click
from aiohttp import web
from rich.console import Console
from rich.table import Table

from kvfleet_sim.catalog import CatalogError
from kvfleet_sim.cli_options import (
    build_engine_config,
    build_lora_config,
    default_of,
    engine_options,
    load_catalog,
    lora_options,
)
from kvfleet_sim.config import ConfigError, derive_layout
from kvfleet_sim.disaggregation import DEFAULT_LINK, MODES, TRANSFER_BACKENDS, DisaggConfig
from kvfleet_sim.faults import FaultPlan
from kvfleet_sim.kv_events import KvEventsConfig
from kvfleet_sim.multinode import DistConfig, DistConfigError, serve_worker
from kvfleet_sim.offline import OfflineSpec, run_offline
from kvfleet_sim.server import ServerConfig, make_app
from kvfleet_sim.tokenizer import TOKENIZER_FILE

JOIN_TIMEOUT_S = 1800.0
"""How long a rank >= 1 waits for rank 0 (torch.distributed's default timeout)."""


@click.group("sim")
def sim() -> None:
    """The SGLang-compatible engine simulator (no GPU needed)."""


@sim.command("serve")
@engine_options
@lora_options
@click.option("--host", default=default_of(ServerConfig, "host"), show_default=True)
@click.option("--port", type=int, default=default_of(ServerConfig, "port"), show_default=True)
@click.option("--served-model-name", default=None, help="Default: the model path as given.")
@click.option(
    "--time-scale",
    type=float,
    default=default_of(ServerConfig, "time_scale"),
    show_default=True,
    help="Wall seconds per simulated GPU second.",
)
@click.option(
    "--startup-delay",
    type=float,
    default=default_of(ServerConfig, "startup_delay_s"),
    show_default=True,
    help="Seconds /health answers 503 (simulated model load).",
)
@click.option(
    "--stream-interval",
    type=int,
    default=default_of(ServerConfig, "stream_interval"),
    show_default=True,
    help="Tokens per streamed chunk.",
)
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' like SGLang.")
@click.option(
    "--kv-events-config",
    default=None,
    help="JSON, as SGLang's: publish KV-cache events, e.g."
    ' \'{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}\'.',
)
@click.option(
    "--tokenizer-path",
    default=None,
    help="Directory with a Hugging Face tokenizer.json to tokenize with (default: the"
    " --model directory when it has one, else the built-in stand-in tokenizer).",
)
@click.option("--no-eos", is_flag=True, help="Never end early: every request runs to its limit.")
@click.option("--enable-metrics", is_flag=True, help="Accepted for SGLang parity; always on.")
@click.option("--fail-nth", type=int, default=None, help="Fault: the Nth request gets HTTP 500.")
@click.option("--stall-nth", type=int, default=None, help="Fault: the Nth request stalls.")
@click.option("--stall-seconds", type=float, default=default_of(FaultPlan, "stall_seconds"))
@click.option(
    "--drop-nth",
    type=int,
    default=None,
    help="Fault: the Nth streaming request's connection is cut mid-stream.",
)
@click.option(
    "--exit-after-chunks",
    type=int,
    default=None,
    help="Fault: the process dies after sending this many stream chunks.",
)
@click.option(
    "--nnodes",
    type=int,
    default=default_of(DistConfig, "nnodes"),
    show_default=True,
    help="Nodes in one engine (SGLang's multi-node: they meet at --dist-init-addr).",
)
@click.option(
    "--node-rank",
    type=int,
    default=default_of(DistConfig, "node_rank"),
    show_default=True,
    help="This node's rank; only rank 0 serves the API.",
)
@click.option(
    "--dist-init-addr",
    "--nccl-init-addr",
    "dist_init_addr",
    default=None,
    help="HOST:PORT of rank 0's rendezvous (--nnodes > 1).",
)
@click.option(
    "--disaggregation-mode",
    type=click.Choice(MODES),
    default="null",
    show_default=True,
    help="SGLang's PD mode: a prefill or a decode server.",
)
@click.option(
    "--disaggregation-bootstrap-port",
    type=int,
    default=default_of(DisaggConfig, "bootstrap_port"),
    show_default=True,
    help="Prefill mode: where decode servers collect the KV.",
)
@click.option(
    "--disaggregation-transfer-backend",
    type=click.Choice(TRANSFER_BACKENDS),
    default=default_of(DisaggConfig, "transfer_backend"),
    show_default=True,
)
@click.option("--disaggregation-ib-device", default=None, help="Accepted for SGLang parity.")
@click.option(
    "--disaggregation-decode-enable-radix-cache",
    is_flag=True,
    help="Decode mode: keep a prefix cache (SGLang's default: none).",
)
@click.option(
    "--disaggregation-link",
    default=DEFAULT_LINK,
    show_default=True,
    help="Simulator: the catalogue link the KV crosses between prefill and decode engines"
    " (nvlink, ib400, roce200, eth100, or a `links:` entry of --catalog).",
)
@click.option("--log-level", default="info", show_default=True)
def serve(**kw: Any) -> None:
    """Serve SGLang's HTTP API from a simulated engine."""
    logging.basicConfig(
        level=kw.pop("log_level").upper(), format="%(asctime)s %(name)s %(message)s"
    )
    model_arg = kw["model"]
    profile, truth = kw.pop("profile"), kw.pop("cost_model")
    catalog = load_catalog(kw["catalog_file"])
    try:
        link = catalog.link(kw.pop("disaggregation_link"))
    except CatalogError as exc:
        raise click.BadParameter(str(exc), param_hint="--disaggregation-link") from exc
    disagg = DisaggConfig(
        kw.pop("disaggregation_mode"),
        kw.pop("disaggregation_bootstrap_port"),
        kw.pop("disaggregation_transfer_backend"),
        link,
    )
    kw.pop("disaggregation_ib_device")
    if disagg.mode == "decode" and not kw.pop("disaggregation_decode_enable_radix_cache"):
        kw["disable_radix_cache"] = True  # as SGLang's decode servers run by default
    kw.pop("disaggregation_decode_enable_radix_cache", None)
    lora = build_lora_config(kw)
    engine = build_engine_config(kw, catalog)
    if lora.enabled:
        engine = dataclasses.replace(
            engine, max_loras_per_batch=lora.max_loras_per_batch, lora_rank=lora.rank
        )
    try:
        derive_layout(engine)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    kw.pop("enable_metrics")
    try:
        dist = DistConfig(kw.pop("nnodes"), kw.pop("node_rank"), kw.pop("dist_init_addr"))
    except DistConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if dist.node_rank >= 1:  # no API here: join rank 0, answer health checks
        click.echo(f"kvfleet sim: rank {dist.node_rank} of {dist.nnodes}", err=True)
        asyncio.run(serve_worker(dist, kw["host"], kw["port"], JOIN_TIMEOUT_S))
        return
    faults = FaultPlan(
        fail_nth=kw.pop("fail_nth"),
        stall_nth=kw.pop("stall_nth"),
        stall_seconds=kw.pop("stall_seconds"),
        drop_nth=kw.pop("drop_nth"),
        exit_after_chunks=kw.pop("exit_after_chunks"),
    )
    if kw["stream_interval"] < 1:
        raise click.UsageError("--stream-interval must be >= 1")
    if kw["time_scale"] <= 0:
        raise click.UsageError("--time-scale must be > 0")
    kv_events = None
    if raw_events := kw.pop("kv_events_config"):
        try:
            kv_events = KvEventsConfig.from_cli(raw_events)
        except (ValueError, TypeError) as exc:
            raise click.UsageError(str(exc)) from exc
    tokenizer_path = kw.pop("tokenizer_path")
    if tokenizer_path is None and model_arg and (Path(model_arg) / TOKENIZER_FILE).is_file():
        tokenizer_path = model_arg
    if tokenizer_path is not None and not (Path(tokenizer_path) / TOKENIZER_FILE).is_file():
        raise click.UsageError(f"--tokenizer-path: no {TOKENIZER_FILE} in {tokenizer_path}")
    config = ServerConfig(
        engine=engine,
        model_path=model_arg or engine.model.name,
        served_model_name=kw.pop("served_model_name") or model_arg or engine.model.name,
        host=kw.pop("host"),
        port=kw.pop("port"),
        time_scale=kw.pop("time_scale"),
        startup_delay_s=kw.pop("startup_delay"),
        stream_interval=kw.pop("stream_interval"),
        api_key=kw.pop("api_key"),
        profile=profile,
        truth=truth,
        simulate_eos=not kw.pop("no_eos"),
        faults=faults,
        kv_events=kv_events,
        tokenizer_path=tokenizer_path,
        dist=dist,
        disagg=disagg,
        lora=lora,
    )
    with contextlib.suppress(ImportError):  # uvloop: the same asyncio API, cheaper sockets
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    click.echo(
        f"kvfleet sim: simulated SGLang engine serving {config.served_model_name} "
        f"({engine.model.name} on {engine.tp_size}x {engine.gpu.name}) at "
        f"http://{config.host}:{config.port}; {config.time_scale:g} wall s per simulated s",
        err=True,
    )
    web.run_app(
        make_app(config),
        host=config.host,
        port=config.port,
        print=None,
        access_log=None,
        handle_signals=True,
    )


@sim.command("offline")
@engine_options
@click.option(
    "--dataset",
    type=click.Choice(["random", "sharegpt"]),
    default=default_of(OfflineSpec, "dataset"),
    show_default=True,
)
@click.option(
    "--num-prompts", type=int, default=default_of(OfflineSpec, "num_prompts"), show_default=True
)
@click.option(
    "--input-len", type=int, default=default_of(OfflineSpec, "input_len"), show_default=True
)
@click.option(
    "--output-len", type=int, default=default_of(OfflineSpec, "output_len"), show_default=True
)
@click.option(
    "--random-range-ratio",
    type=float,
    default=default_of(OfflineSpec, "range_ratio"),
    show_default=True,
)
@click.option("--seed", type=int, default=default_of(OfflineSpec, "seed"), show_default=True)
@click.option(
    "--request-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=default_of(OfflineSpec, "request_rate"),
    help="Poisson arrivals at this many requests/s, as bench_serving; default: all at once.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def offline(**kw: Any) -> None:
    """Throughput, like sglang.bench_offline_throughput (all prompts at once) or
    bench_serving at a request rate."""
    as_json = kw.pop("as_json")
    profile, truth = kw.pop("profile"), kw.pop("cost_model")
    engine = build_engine_config(kw)
    spec = OfflineSpec(
        dataset=kw["dataset"],
        num_prompts=kw["num_prompts"],
        input_len=kw["input_len"],
        output_len=kw["output_len"],
        range_ratio=kw["random_range_ratio"],
        seed=kw["seed"],
        request_rate=kw["request_rate"],
    )
    try:
        result = run_offline(engine, spec, profile, truth)
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from exc
    table = Table(
        title=f"{engine.model.name} on {engine.tp_size}× {engine.gpu.name} ({profile})",
        caption="simulated: durations and rates are in simulated GPU time, not wall time",
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.as_dict().items():
        label = "duration_s (simulated)" if key == "duration_s" else key
        table.add_row(label, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}")
    Console(stderr=as_json).print(table)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
