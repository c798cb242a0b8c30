"""What one replica can complete per second at most: a roofline over the recent request mix.

A replica spends on each request its uncached prefill, U tokens at the prefill rate P, and
its share of the decode steps: O output tokens, one per step, each step shared by the B
requests of the batch and taking `base + B × kv × kv_read` (the weights streamed once, every
token of KV in use read once). B is as many requests of `kv` tokens as the KV cache holds,
at most the engine's batch slots. So

    throughput = 1 / (U / P + O × step(B) / B)    requests per second.

An upper bound, not a working point: queueing, retractions and the interference of prefill
chunks with decode are left out. The autoscaler plans from it before the fleet has shown
where its limit is, and learns below it from the ticks that fell behind.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMix:
    """The mean request lately, in tokens."""

    uncached_tokens: float
    """Prompt tokens the replica prefilled (its prefix cache missed)."""
    output_tokens: float
    kv_tokens: float
    """Prompt + half the output: a request's KV footprint midway through its decode."""

    def moved(self, other: RequestMix, gain: float) -> RequestMix:
        """This mean moved `gain` of the way towards `other` (an exponential average)."""
        return RequestMix(
            self.uncached_tokens + gain * (other.uncached_tokens - self.uncached_tokens),
            self.output_tokens + gain * (other.output_tokens - self.output_tokens),
            self.kv_tokens + gain * (other.kv_tokens - self.kv_tokens),
        )


def replica_throughput(
    mix: RequestMix,
    prefill_tokens_per_second: float,
    decode_step_base_s: float,
    kv_read_s_per_token: float,
    pool_tokens: int,
    slots: int | None = None,
) -> float:
    """Requests per second one replica completes at most at `mix` (see the module)."""
    batch = max(1.0, pool_tokens / max(1.0, mix.kv_tokens))
    if slots is not None:
        batch = min(batch, float(slots))
    step_s = decode_step_base_s + batch * mix.kv_tokens * kv_read_s_per_token
    seconds = mix.uncached_tokens / prefill_tokens_per_second + mix.output_tokens * step_s / batch
    return 1.0 / seconds if seconds > 0 else 0.0
