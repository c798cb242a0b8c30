"""The API's shared vocabulary: a served kind of object, and the errors a request ends with
(each a `Status` object with its HTTP code, as a real API server answers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ApiError(Exception):
    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details
        """A real Status's `details` (name, group, kind, causes): kubectl prints the causes."""

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            status["details"] = self.details
        return status


class Gone(ApiError):
    def __init__(self, rv: str) -> None:
        super().__init__(410, "Expired", f"too old resource version: {rv}")


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: frozenset[str] = frozenset()
    spec_replicas_path: str = "spec.replicas"
    status_replicas_path: str = "status.replicas"
    selector_path: str | None = "status.selector"

    @property
    def key(self) -> tuple[str, str]:
        return self.group, self.plural

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version
