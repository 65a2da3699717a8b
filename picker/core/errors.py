"""The picker's exception tree. Each error carries the HTTP status the client gets.

Raised anywhere below the protocol layer; translated exactly once, in :mod:`picker.serving.extproc`,
into an Envoy ``ImmediateResponse`` with a JSON body ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations


class PickerError(Exception):
    """Base class. ``status`` is the HTTP status code sent to the client."""

    status: int = 500
    kind: str = "internal_error"
    retry_after_s: int = 0
    """Seconds for the client's ``Retry-After`` header (0: none); flow control sets it on a 429."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(PickerError):
    """The body is not valid JSON/UTF-8, lacks ``model``, or has the wrong shape."""

    status = 400
    kind = "invalid_request_error"


class BodyTooLarge(PickerError):
    """The request body exceeds ``max_body_bytes``."""

    status = 413
    kind = "request_too_large"


class Overloaded(PickerError):
    """Every candidate endpoint is saturated: the request is shed."""

    status = 429
    kind = "overloaded"


class NoEndpoints(PickerError):
    """No ready endpoint exists for the request."""

    status = 503
    kind = "no_endpoints"


class InternalError(PickerError):
    """An unexpected exception while processing a request; the original is chained as its cause
    and logged with its traceback where it is translated."""

    status = 500
    kind = "internal_error"


class Unauthorized(PickerError):
    """A debug or metrics request without the configured bearer token (``--debug-token-file``,
    ``--metrics-token-file``)."""

    status = 401
    kind = "unauthorized"
