"""The serving layer built around a router, as :class:`picker.serving.server.PickerServer` wires
it, for tests that drive the ext_proc protocol in process."""

from __future__ import annotations

from picker.core.router import Router
from picker.serving.director import Director
from picker.serving.extproc import FULL_DUPLEX, ExtProcService
from picker.serving.offload import BodyParser
from picker.serving.telemetry import Telemetry
from picker.serving.tokenization import Tokenization


def director(
    router: Router, telemetry: Telemetry | None = None, parser: BodyParser | None = None
) -> Director:
    """A director with the tokenization ``router``'s config names (none in approximate mode)."""
    return Director(router, Tokenization.from_config(router, router.cfg.prefix), telemetry, parser)


def service(
    router: Router,
    telemetry: Telemetry | None = None,
    default_mode: int = FULL_DUPLEX,
    response_headers: str = "when-needed",
) -> ExtProcService:
    return ExtProcService(director(router, telemetry), default_mode, response_headers)
