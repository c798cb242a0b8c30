"""What the simulated server sends back: final bodies and SSE streams, per endpoint kind.

SSE framing is SGLang's: `data: {json}\\n\\n` events, `data: [DONE]\\n\\n` last. `/generate`
streams cumulative text; the OpenAI endpoints stream deltas and, when the client asked with
`stream_options.include_usage`, a final chunk with empty choices and the usage.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvfleet_sim import api
from kvfleet_sim.realtime import Channel
from kvfleet_sim.request import FINISH_STOP, Request

if TYPE_CHECKING:
    from kvfleet_sim.server import SimState


async def wait_finished(req: Request, channel: Channel) -> None:
    while not req.finished:
        await channel.wait()


def generated_text(st: SimState, req: Request, upto: int | None = None) -> str:
    tok = st.engine.tokenizer
    n = req.output_len if upto is None else upto
    text = tok.decode(tok.generate_ids(req.seed, n))
    if req.finish_reason == FINISH_STOP and isinstance(req.stop_matched, str) and upto is None:
        cut = text.find(req.stop_matched)
        text = text[:cut] if cut >= 0 else text  # stop strings are trimmed, as in SGLang
    return text


def openai_finish(st: SimState, req: Request) -> tuple[str | None, str | int | None]:
    if req.finish_reason is None:
        return None, None
    if req.finish_reason == "stop":
        # A natural end reports the model's own end-of-sequence token (its config's).
        eos = st.config.engine.model.stop_token_id
        matched = req.stop_matched if req.stop_matched is not None else eos
        return "stop", matched
    if req.finish_reason == "abort":
        return "abort", None
    return "length", None


def meta_info(st: SimState, req: Request, final: bool) -> dict[str, Any]:
    _, matched = openai_finish(st, req)
    info: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": api.finish_reason_native(req.finish_reason, matched, req.output_len),
        "prompt_tokens": req.prompt_len,
        "completion_tokens": req.output_len,
        "cached_tokens": req.cached_tokens,
        "weight_version": "default",
    }
    if final and req.finish_time is not None:
        info["e2e_latency"] = req.finish_time - req.arrival_time
    return info


def final_body(st: SimState, gen: api.GenRequest, req: Request) -> dict[str, Any]:
    text = generated_text(st, req)
    if gen.kind == "generate":
        return {
            "text": text,
            "output_ids": st.engine.tokenizer.generate_ids(req.seed, req.output_len),
            "meta_info": meta_info(st, req, final=True),
        }
    finish, matched = openai_finish(st, req)
    base = {
        "id": req.rid,
        "created": api.now_s(),
        "model": st.config.served_model_name,
        "usage": api.usage(req.prompt_len, req.output_len, req.cached_tokens),
    }
    if gen.kind == "completion":
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        return {**base, "object": "text_completion", "choices": [choice]}
    message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": matched,
    }
    return {**base, "object": "chat.completion", "choices": [choice]}


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _Chunker:
    """Turns engine progress into the endpoint's SSE events."""

    def __init__(self, st: SimState, gen: api.GenRequest, req: Request) -> None:
        self.st, self.gen, self.req = st, gen, req
        self.sent_text = ""
        self.created = api.now_s()
        self.started = False
        self._ids = st.engine.tokenizer.generate(req.seed)
        self._pieces: list[str] = []
        self._text = ""

    def _visible_text(self) -> str:
        """Text so far, built incrementally; a possible partial stop string is held back."""
        tok, req = self.st.engine.tokenizer, self.req
        if len(self._pieces) < req.output_len:
            while len(self._pieces) < req.output_len:
                self._pieces.append(tok.decode([next(self._ids)]))
            self._text = "".join(self._pieces)
        text = self._text
        stop = req.stop_matched if isinstance(req.stop_matched, str) else None
        if req.finished and req.finish_reason == FINISH_STOP and stop:
            cut = text.find(stop)
            return text[:cut] if cut >= 0 else text
        if not req.finished and self.gen.stop:
            hold = max(len(s) for s in self.gen.stop) - 1
            return text[: max(len(self.sent_text), len(text) - hold)]
        return text

    def _openai(self, choice: dict[str, Any]) -> bytes:
        req = self.req
        obj = "text_completion" if self.gen.kind == "completion" else "chat.completion.chunk"
        return _event(
            {
                "id": self.req.rid,
                "object": obj,
                "created": self.created,
                "model": self.st.config.served_model_name,
                "choices": [choice],
                # SGLang's `stream_options.continuous_usage_stats`: the counts so far, in
                # every chunk (the prompt is counted from the first one).
                "usage": api.usage(req.prompt_len, req.output_len, req.cached_tokens)
                if self.gen.continuous_usage
                else None,
            }
        )

    def progress(self) -> list[bytes]:
        req = self.req
        text = self._visible_text()
        delta, self.sent_text = text[len(self.sent_text) :], text
        if self.gen.kind == "generate":
            payload = {
                "text": text,
                "output_ids": [],
                "meta_info": meta_info(self.st, req, final=req.finished),
                "index": 0,
            }
            return [_event(payload)]
        finish, matched = openai_finish(self.st, req)
        events: list[bytes] = []
        if self.gen.kind == "chat":
            if not self.started:
                events.append(
                    self._openai(
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
            self.started = True
            if delta or finish:
                events.append(
                    self._openai(
                        {
                            "index": 0,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": None,
                            "finish_reason": finish,
                            "matched_stop": matched,
                        }
                    )
                )
        elif delta or finish:
            events.append(
                self._openai(
                    {
                        "index": 0,
                        "text": delta,
                        "logprobs": None,
                        "finish_reason": finish,
                        "matched_stop": matched,
                    }
                )
            )
        return events

    def closing(self) -> list[bytes]:
        events: list[bytes] = []
        if self.gen.kind != "generate" and self.gen.include_usage:
            req = self.req
            events.append(
                _event(
                    {
                        "id": req.rid,
                        "object": "text_completion"
                        if self.gen.kind == "completion"
                        else "chat.completion.chunk",
                        "created": self.created,
                        "model": self.st.config.served_model_name,
                        "choices": [],
                        "usage": api.usage(req.prompt_len, req.output_len, req.cached_tokens),
                    }
                )
            )
        events.append(b"data: [DONE]\n\n")
        return events


async def stream_response(
    request: web.Request,
    st: SimState,
    gen: api.GenRequest,
    req: Request,
    channel: Channel,
    drop_after: int | None = None,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await resp.prepare(request)
        await _relay(request, st, gen, req, channel, resp, drop_after)
    except ConnectionResetError:
        pass  # the client left: the caller aborts the request (SGLang does the same, quietly)
    return resp


async def _relay(
    request: web.Request,
    st: SimState,
    gen: api.GenRequest,
    req: Request,
    channel: Channel,
    resp: web.StreamResponse,
    drop_after: int | None,
) -> None:
    from kvfleet_sim.server import exit_now

    chunker = _Chunker(st, gen, req)
    interval = st.config.stream_interval
    sent_tokens, chunks = 0, 0
    exit_after = st.faults.plan.exit_after_chunks
    while True:
        await channel.wait()
        if req.aborted and not req.finished:
            break
        due = req.finished or sent_tokens == 0 or req.output_len - sent_tokens >= interval
        if (req.output_len and due) or (req.finished and chunks == 0):
            for event in chunker.progress():
                await resp.write(event)
            sent_tokens = req.output_len
            chunks += 1
            st.faults.chunks_sent += 1
            if exit_after is not None and st.faults.chunks_sent >= exit_after:
                exit_now()
            if drop_after is not None and chunks >= drop_after and not req.finished:
                if request.transport is not None:
                    request.transport.abort()  # the injected fault: cut the connection
                break
        if req.finished:
            for event in chunker.closing():
                await resp.write(event)
            break
