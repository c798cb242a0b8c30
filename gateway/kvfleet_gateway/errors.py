"""OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json

from aiohttp import web


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers={**(headers or {}), **self.headers},
        )


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", None, param)


class ClientGone(Exception):
    """The client closed its connection before its request was done (status 499, nginx's
    "client closed request"): its doing, logged as one INFO line, never a traceback."""

    def __init__(self, tenant: str, when: str) -> None:
        super().__init__(f"client of {tenant} left {when}")
        self.tenant, self.when = tenant, when
