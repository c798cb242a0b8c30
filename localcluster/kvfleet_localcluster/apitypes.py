"""The error an API request ends with: the `Status` a real API server answers (its HTTP code,
reason and message), raised by the local cluster's client (`kubeapi.py`) and by the node
agent's kubelet API for a request it refuses."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
