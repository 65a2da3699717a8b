"""The one error encoder: a :class:`~picker.core.errors.PickerError` as each face sends it.

- ext_proc (:mod:`picker.serving.extproc`): an ``ImmediateResponse`` with ``status``, ``body`` and
  the details string ``details``;
- the debug HTTP API (:mod:`picker.serving.http`): ``status`` and ``body``;
- gRPC Explain (:mod:`picker.serving.explain`): ``grpc_code`` with the message.

The body is always ``{"error": {"message", "type", "code"}}`` as JSON (OpenAI's error shape, with
the HTTP status as ``code``), so a client sees one shape whichever face answered.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import orjson

from picker.core.errors import PickerError

_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
"""HTTP status → gRPC status; anything else is INTERNAL."""

CONTENT_TYPE = "application/json"


@dataclass(frozen=True, slots=True)
class EncodedError:
    status: int
    """The HTTP status."""
    body: bytes
    """``{"error": {...}}`` as JSON."""
    details: str
    """``kvpick_<kind>``: Envoy's response-code details for an ImmediateResponse."""
    grpc_code: grpc.StatusCode
    message: str


def encode(err: PickerError) -> EncodedError:
    body = orjson.dumps({"error": {"message": err.message, "type": err.kind, "code": err.status}})
    return EncodedError(
        status=err.status,
        body=body,
        details=f"kvpick_{err.kind}",
        grpc_code=_GRPC.get(err.status, grpc.StatusCode.INTERNAL),
        message=err.message,
    )
