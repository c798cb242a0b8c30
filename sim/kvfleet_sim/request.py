"""One generation request as the engine tracks it (SGLang's `Req`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_sim.radix import Node

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"


@dataclass(eq=False, slots=True)
class Request:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_time: float
    seed: int = 0
    stop_at: int | None = None
    """Output length at which a stop string completes (precomputed by the server)."""
    stop_matched: str | None = None
    cache_salt: str | None = None
    adapter: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    """The radix cache's namespace for this request (SGLang's `cache_salt`)."""
    tag: object = None
    """Opaque owner data (the server's stream, the fleet's record); the engine never reads it."""
    prefilled: bool = False
    """Disaggregated decode: the prompt's KV arrived from a prefill engine; admission only
    allocates it (no compute) and the first token comes out at once."""

    # Engine state.
    output_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    """Materialised lazily: on retraction (re-prefill needs them) and at the end."""
    kv_len: int = 0
    """Tokens of prompt + output whose KV is allocated (including the locked cached prefix)."""
    prefix_len: int = 0
    """Leading tokens held by the radix cache and locked by this request."""
    node: Node | None = None
    cached_tokens: int = 0
    """Prompt tokens served from the cache, as reported in `meta_info` / usage."""
    retractions: int = 0
    aborted: bool = False
    finish_reason: str | None = None

    # Timestamps (engine clock, seconds).
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def fill_len(self) -> int:
        """Tokens a (re-)prefill computes KV for: prompt plus output kept by a retraction."""
        return self.prompt_len + self.output_len

    @property
    def remaining_new_tokens(self) -> int:
        limit = self.max_new_tokens
        if self.stop_at is not None:
            limit = min(limit, self.stop_at)
        return max(0, limit - self.output_len)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
