"""inference-perf's own config file as a fleet workload: replay in the simulator the very file
a team runs against its cluster (`inference-perf -c W.yaml`).

Read: `data` — `type: shared_prefix` with `shared_prefix.num_groups` (or
`num_unique_system_prompts`), `num_prompts_per_group` (or `num_users_per_system_prompt`),
`system_prompt_len`, `question_len`, `output_len` (a number, or a distribution whose `mean`
is taken); `type: random` / `synthetic` with `input_distribution` and `output_distribution`;
`type: shareGPT` (the simulator's ShareGPT length distribution, no download) — and `load` —
`type: constant` (evenly spaced) or `poisson`, `stages` as a list of `rate` × `duration`, and
`interval` between stages. Stages run back to back on one fleet, as inference-perf runs them on
one server (caches stay warm), and each is reported on its own. Everything else in the file
(`api`, `server`, `tokenizer`, `report`, ...) is about the client and is ignored.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from kvfleet_sim.fleet.workloads import WorkloadSpec

ArrivalKind = Literal["constant", "poisson"]


class WorkloadFileError(ValueError):
    """A workload file this simulator cannot replay, and why (file and field named)."""


@dataclass(frozen=True)
class Stage:
    rate: float
    """Requests per second."""
    duration_s: float
    start_s: float
    """When the stage begins, from the start of the run."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def requests(self) -> int:
        return max(1, round(self.rate * self.duration_s))


@dataclass(frozen=True)
class StagedArrivals:
    """Arrival times stage after stage: evenly spaced (constant) or Poisson within each."""

    kind: ArrivalKind
    stages: tuple[Stage, ...]

    def arrivals(self, n: int, rng: random.Random) -> list[float]:
        out: list[float] = []
        for s in self.stages:
            if self.kind == "constant":
                out += [s.start_s + i / s.rate for i in range(s.requests)]
            else:
                t = s.start_s
                for _ in range(s.requests):
                    t += rng.expovariate(s.rate)
                    out.append(min(t, s.end_s))
        return out[:n]

    @property
    def total_requests(self) -> int:
        return sum(s.requests for s in self.stages)


@dataclass(frozen=True)
class WorkloadFile:
    name: str
    spec: WorkloadSpec
    arrivals: StagedArrivals


def _mean(value: Any, where: str) -> int:
    if isinstance(value, Mapping):
        value = value.get("mean", value.get("max"))
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise WorkloadFileError(f"{where}: expected a positive number or a distribution")
    return round(value)


def _pick(block: Mapping[str, Any], names: tuple[str, ...], default: Any) -> Any:
    return next((block[n] for n in names if n in block), default)


def _data(doc: Mapping[str, Any], origin: str, seed: int) -> WorkloadSpec:
    data = doc.get("data") or {}
    kind = str(data.get("type", "mock"))
    where = f"{origin}: data"

    def num(block: Mapping[str, Any], key: str, default: int) -> int:
        return _mean(block.get(key) or default, f"{where}.{key}")

    if kind == "shared_prefix":
        sp = data.get("shared_prefix") or {}
        return WorkloadSpec(
            "generated-shared-prefix",
            seed=seed,
            gsp_num_groups=_mean(
                _pick(sp, ("num_groups", "num_unique_system_prompts"), 10), f"{where}.num_groups"
            ),
            gsp_prompts_per_group=_mean(
                _pick(sp, ("num_prompts_per_group", "num_users_per_system_prompt"), 10),
                f"{where}.num_prompts_per_group",
            ),
            gsp_system_prompt_len=num(sp, "system_prompt_len", 100),
            gsp_question_len=num(sp, "question_len", 50),
            gsp_output_len=num(sp, "output_len", 50),
        )
    if kind in ("random", "synthetic"):
        return WorkloadSpec(
            "random",
            seed=seed,
            input_len=num(data, "input_distribution", 512),
            output_len=num(data, "output_distribution", 512),
        )
    if kind == "shareGPT":
        return WorkloadSpec("sharegpt", seed=seed)
    raise WorkloadFileError(
        f"{where}.type {kind!r}: this simulator replays shared_prefix, random, synthetic and"
        " shareGPT data"
    )


def _load(doc: Mapping[str, Any], origin: str) -> StagedArrivals:
    load = doc.get("load") or {}
    kind = str(load.get("type", "constant"))
    if kind not in ("constant", "poisson"):
        raise WorkloadFileError(
            f"{origin}: load.type {kind!r}: only constant and poisson stages can be replayed"
        )
    gap = float(load.get("interval", 1.0))
    stages: list[Stage] = []
    t = 0.0
    for i, raw in enumerate(load.get("stages") or []):
        where = f"{origin}: load.stages[{i}]"
        if not isinstance(raw, Mapping) or "rate" not in raw or "duration" not in raw:
            raise WorkloadFileError(f"{where}: expected rate and duration")
        rate, duration = raw["rate"], raw["duration"]
        for name, value in (("rate", rate), ("duration", duration)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise WorkloadFileError(f"{where}.{name}: expected a positive number")
        stages.append(Stage(float(rate), float(duration), t))
        t += float(duration) + gap
    if not stages:
        raise WorkloadFileError(f"{origin}: load.stages is empty (a sweep is not replayable)")
    return StagedArrivals(kind, tuple(stages))  # type: ignore[arg-type]


def parse_workload_file(text: str, origin: str, seed: int = 1) -> WorkloadFile:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise WorkloadFileError(f"{origin}: invalid YAML{at}") from exc
    if not isinstance(doc, Mapping):
        raise WorkloadFileError(f"{origin}: expected inference-perf's config (a mapping)")
    arrivals = _load(doc, origin)
    spec = replace(_data(doc, origin, seed), num_requests=arrivals.total_requests)
    return WorkloadFile(Path(origin).stem, spec, arrivals)


def load_workload_file(path: Path, seed: int = 1) -> WorkloadFile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse_workload_file(text, str(path), seed)
