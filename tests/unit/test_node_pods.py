"""The node agent's pod references and status writes, when the API server fails to answer:
asked again, never the end of the task that asked (a pod left Pending with no status, or a
node whose pods all kept their last status)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvfleet_localcluster import node_pods
from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.node_pods import ReferenceCache, StatusWriter
from tests.support.waiting import until

POD_META = {"namespace": "ai", "name": "engine-0", "uid": "u1"}
POD_SPEC = {
    "automountServiceAccountToken": False,
    "volumes": [{"name": "key", "secret": {"secretName": "engine-key"}}],
}


class FlakyClient:
    """Fails each method's first `failures` calls with `error`, then answers."""

    def __init__(self, error: BaseException, failures: int = 1) -> None:
        self.error, self.failures = error, failures
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _answer(self, method: str, args: tuple[Any, ...]) -> None:
        self.calls.append((method, args))
        if sum(1 for m, _ in self.calls if m == method) <= self.failures:
            raise self.error

    async def get(self, *args: Any) -> dict[str, Any]:
        self._answer("get", args)
        return {"metadata": {"name": args[2]}}

    async def patch(self, *args: Any, **kw: Any) -> dict[str, Any]:
        self._answer("patch", args)
        return {}


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_pods, "RETRY_S", 0.01)


@pytest.mark.parametrize(
    "error",
    [
        aiohttp.ServerDisconnectedError(),
        ConnectionResetError("reset"),
        TimeoutError(),
        ApiError(503, "ServiceUnavailable", "the server is busy"),
    ],
    ids=["disconnected", "reset", "timeout", "503"],
)
async def test_a_pods_references_are_asked_again_until_the_api_server_answers(
    error: BaseException,
) -> None:
    client = FlakyClient(error, failures=2)
    refs = ReferenceCache(client)  # type: ignore[arg-type]
    await asyncio.wait_for(refs.first_refresh(POD_META, POD_SPEC), 5)
    assert refs.read("ai", "Secret", "engine-key") == {"metadata": {"name": "engine-key"}}
    assert [m for m, _ in client.calls] == ["get"] * 3


async def test_a_missing_reference_is_not_retried() -> None:
    client = FlakyClient(ApiError(404, "NotFound", "not found"), failures=1)
    refs = ReferenceCache(client)  # type: ignore[arg-type]
    await asyncio.wait_for(refs.first_refresh(POD_META, POD_SPEC), 5)
    assert refs.read("ai", "Secret", "engine-key") is None
    assert len(client.calls) == 1


async def test_the_status_writer_outlives_a_dropped_connection() -> None:
    client = FlakyClient(aiohttp.ServerDisconnectedError(), failures=1)
    writer = StatusWriter(client)  # type: ignore[arg-type]
    task = asyncio.create_task(writer.run())
    try:
        writer.submit("ai", "engine-0", "u1", {"phase": "Running"})

        def patched(count: int) -> bool:
            return sum(1 for m, _ in client.calls if m == "patch") >= count

        await until(lambda: patched(2), 5, "the failed write, then the same one again")
        assert client.calls[1][1][3] == {"metadata": {"uid": "u1"}, "status": {"phase": "Running"}}
        writer.submit("ai", "engine-1", "u2", {"phase": "Pending"})  # and it goes on writing
        await until(lambda: patched(3), 5, "the next pod's status")
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
