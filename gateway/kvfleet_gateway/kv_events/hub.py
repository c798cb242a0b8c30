"""Fetching a model's tokenizer files from the Hugging Face Hub (the gateway pod's init
container, when the engines download the model from the Hub too).

Only the tokenizer: `tokenizer.json` (required: the gateway tokenizes with Hugging Face
`tokenizers`), `tokenizer_config.json` and `chat_template.jinja` (the chat template lives in
one or the other); and the small `config.json`, which the routing priors read. `HF_ENDPOINT`
and `HF_TOKEN` are read as `huggingface_hub` reads them, so a mirror or a gated model works the
same as for the engines.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import quote

import aiohttp

from kvfleet_gateway.kv_events.prompts import CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_FILE
from kvfleet_gateway.model_config import CONFIG_FILE as MODEL_CONFIG_FILE

DEFAULT_ENDPOINT = "https://huggingface.co"
FILES = (
    (TOKENIZER_FILE, True),
    (CONFIG_FILE, False),
    (TEMPLATE_FILE, False),
    (MODEL_CONFIG_FILE, False),
)
"""(file, required)."""


class HubError(RuntimeError):
    pass


async def fetch_tokenizer(
    repo: str,
    dest: Path,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> list[str]:
    """Download the tokenizer files of `repo` into `dest`; the names written."""
    base = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = token or os.environ.get("HF_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
    written: list[str] = []
    timeout = aiohttp.ClientTimeout(total=300, connect=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            for name, required in FILES:
                if await _fetch(session, base, repo, revision, name, required, dest):
                    written.append(name)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise HubError(f"{base}: {e or type(e).__name__}") from None
    return written


async def _fetch(
    session: aiohttp.ClientSession,
    base: str,
    repo: str,
    revision: str | None,
    name: str,
    required: bool,
    dest: Path,
) -> bool:
    url = f"{base}/{repo}/resolve/{quote(revision or 'main', safe='')}/{name}"
    async with session.get(url) as r:
        if r.status == 404 and not required:
            return False
        if r.status in (401, 403):
            raise HubError(
                f"{url}: HTTP {r.status} — a gated or private model needs HF_TOKEN"
                " (model.hfTokenSecret)"
            )
        if r.status != 200:
            what = "the model has no fast tokenizer" if r.status == 404 else "failed"
            raise HubError(f"{url}: HTTP {r.status} ({what})")
        data = await r.read()
    await asyncio.to_thread(_write, dest, name, data)
    return True


def _write(dest: Path, name: str, data: bytes) -> None:
    part = dest / f".{name}.partial"
    part.write_bytes(data)
    part.replace(dest / name)  # whole or absent: a restarted init container retries
