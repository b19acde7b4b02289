"""The failures the fake API server answers with, worded as kube-apiserver words them.

Each is a `Status` object (kind Status, apiVersion v1, status Failure) with the HTTP code, the
standard reason (NotFound, AlreadyExists, Conflict, Invalid, BadRequest, ...) and, where the real
server gives them, details naming the object, so clients that parse `reason` or `details` work.
"""

from __future__ import annotations

from typing import Any

from testkit.apistore import Obj
from testkit.kinds import Kind


class ApiError(Exception):
    """A failure the real server reports as a `Status` object with this code and reason."""

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(kind: Kind, name: str) -> ApiError:
    details = {"name": name, "kind": kind.plural}
    if kind.group:
        details["group"] = kind.group
    return ApiError(404, "NotFound", f'{kind.resource} "{name}" not found', details)


def conflict(kind: Kind, name: str, why: str) -> ApiError:
    details = {"name": name, "kind": kind.plural}
    if kind.group:
        details["group"] = kind.group
    message = f'Operation cannot be fulfilled on {kind.resource} "{name}": {why}'
    return ApiError(409, "Conflict", message, details)


STALE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def invalid(kind: Kind, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """422 Invalid, worded as the real server does: `Pod "x" is invalid: field: message`."""
    text = ", ".join(f"{path}: {msg}" for path, msg in causes)
    details: Obj = {
        "name": name,
        "kind": kind.kind,
        "causes": [
            {"reason": "FieldValueInvalid", "message": msg, "field": path} for path, msg in causes
        ],
    }
    if kind.group:
        details["group"] = kind.group
    return ApiError(422, "Invalid", f'{kind.kind} "{name}" is invalid: {text}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)
