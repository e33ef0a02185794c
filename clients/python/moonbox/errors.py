"""The error every failed call raises: the server's error body
{code, message, context, httpStatus} as an exception."""
from __future__ import annotations

from typing import Any, Dict, Optional


class MoonboxError(Exception):
    """A call failed. ``code`` is the server's error code
    (``SESSION_NOT_FOUND``, ``VALIDATION_FAILED``, ...), ``status`` the HTTP
    status (None when no response came: ``CONNECTION_FAILED``,
    ``CLIENT_TIMEOUT``, ``BAD_RESPONSE``), ``context`` the error's context."""

    code: str
    message: str
    status: Optional[int]
    context: Dict[str, Any]

    def __init__(self, code: str, message: str, status: Optional[int] = None,
                 context: Optional[Dict[str, Any]] = None) -> None:
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message
        self.status = status
        self.context = context if context is not None else {}

    @classmethod
    def from_body(cls, status: int, body: Any) -> "MoonboxError":
        """An error from a response body (an error event's ``error`` too)."""
        if isinstance(body, dict) and isinstance(body.get("code"), str):
            ctx = body.get("context")
            return cls(body["code"], str(body.get("message", "")), body.get("httpStatus", status),
                       ctx if isinstance(ctx, dict) else {})
        return cls("HTTP_ERROR", "HTTP %d with a body that is not an error object" % status, status)
