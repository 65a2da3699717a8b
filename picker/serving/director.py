"""The director: one request's life between the gateway protocol and the router.

    parse → tokenize → route → start → (recredit) → (first byte) → finish → telemetry

:mod:`picker.serving.extproc` only moves Envoy's messages and calls these steps; the explain
APIs (:mod:`picker.serving.explain`, the debug HTTP face) call :meth:`Director.explain`, which
parses and tokenizes exactly as a routed request is, then routes without committing.

Steps and where they run:

- :meth:`prepare` (async): work that must leave the event loop, before the pick: a body of at
  least ``parse_offload_bytes`` is parsed in the worker process (:mod:`picker.serving.offload`);
  the prompt is tokenized (:mod:`picker.serving.tokenization`). Called only where
  :meth:`needs_prepare` says so; every other body is parsed inline by :meth:`pick`.
- :meth:`pick` / :meth:`pick_bodiless` (sync): route, start the accounting, count the request.
- :meth:`served`, :meth:`first_byte`, :meth:`finish`: the response path and the end.

Writer of a :class:`Pick`'s fields: this module only. Every :meth:`pick` is matched by exactly
one effective :meth:`finish` (the router's invariant), which the protocol calls however its
stream ends.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from picker.core import request as request_mod
from picker.core.accounting import Ticket
from picker.core.errors import BadRequest
from picker.core.request import Parsed
from picker.core.router import Router
from picker.serving.offload import BodyParser
from picker.serving.telemetry import Telemetry
from picker.serving.tokenization import Tokenization

if TYPE_CHECKING:
    from picker.serving.flow import FlowGate


@dataclass(slots=True)
class Pick:
    """One routed request: where it went and its accounting ticket."""

    request_id: str
    """The client's ``x-request-id``, or the one generated for it."""
    chosen: list[str]
    """Endpoint keys, primary first (after :meth:`Director.served`: the serving one first)."""
    ticket: Ticket | None
    """None for a bodiless request (no scheduling, no accounting)."""
    label: str
    """The ``decision`` label of ``kvpick_requests_total``: ``prefix_hit``, ``prefix_miss`` or
    ``bodiless``, then ``:2xx``-style once the response status is known."""
    destination: str
    """The one value of both the destination header and the ``envoy.lb`` metadata (the protocol
    forbids two different values): :attr:`chosen`, comma-separated. Kept in step with it."""
    prefill: str = ""
    """The prefill endpoint's ``ip:port`` when the request is disaggregated (the
    ``x-prefiller-host-port`` header's value), else ""."""


class Director:
    """Runs the steps of the module doc for every request of one picker."""

    def __init__(
        self,
        router: Router,
        tokenization: Tokenization,
        telemetry: Telemetry | None = None,
        parser: BodyParser | None = None,
    ) -> None:
        self.router, self.tokenization, self.telemetry, self.parser = router, tokenization, telemetry, parser
        self.tokenizes = tokenization.enabled
        """Whether every body goes through :meth:`prepare` (fixed at construction)."""
        self.parse_options = router.parse_options
        """How bodies are parsed: the router's view, keeping the document when tokenization
        needs it (the router sets that from the same config)."""
        self.flow: FlowGate | None = None
        """Flow control's gate, when on: a body is admitted through it before its pick, and
        every finish pokes it. Writer: the gate's builder (:class:`picker.serving.server.PickerServer`
        or a test), once, before the first request."""

    # -- before the pick -----------------------------------------------------------------------
    def needs_prepare(self, size: int) -> bool:
        """Whether a whole body of ``size`` bytes goes through :meth:`prepare` (off-loop parse or
        tokenization) rather than straight to :meth:`pick`."""
        if size <= 0:
            return False
        return self.tokenizes or (self.parser is not None and self.parser.offloads(size))

    async def prepare(
        self,
        chunks: Sequence[bytes],
        size: int,
        headers: Mapping[str, str],
        subset: Collection[str] | None = None,
    ) -> Parsed:
        """Parse (in the worker process when the body is large) and tokenize one whole body.
        Raises :class:`~picker.core.errors.PickerError` (400) for a body that does not parse."""
        path = headers.get(":path", "")
        if self.parser is not None and self.parser.offloads(size):
            parsed = await self.parser.parse(chunks, path, headers, self.parse_options)
        else:
            parsed = self.parse(chunks, headers)
        req, new_body, doc = parsed
        if doc is not None and self.tokenizes:
            req = await self.tokenization.tokenize(req, doc, path, size, subset)
            parsed = (req, new_body, doc)
        return parsed

    def parse(self, chunks: Sequence[bytes], headers: Mapping[str, str]) -> Parsed:
        """Parse one whole body inline (on the caller's thread)."""
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return request_mod.parse_and_rewrite(body, headers.get(":path", ""), headers, self.parse_options)

    # -- the pick -------------------------------------------------------------------------------
    def pick(self, parsed: Parsed, subset: Collection[str] | None = None) -> tuple[Pick, bytes | None]:
        """Route ``parsed`` and start its accounting. Returns the pick and the rewritten body (None
        when unchanged). Raises :class:`~picker.core.errors.PickerError` (no endpoint, shed)."""
        req, new_body, _ = parsed
        decision = self.router.route(req, subset=subset)
        ticket = self.router.start(decision)
        chosen = [e.key for e in decision.chosen]
        if req.prompt_token_estimate:  # tokenized only in part: remembered for its siblings
            self.tokenization.picked(req.request_id, chosen[0])
        cyc = decision.cycle
        label = "prefix_hit" if cyc.matches.get(chosen[0], 0) else "prefix_miss"
        prefill = decision.prefill
        t = self.telemetry
        if t is not None:
            t.count_request(req.model, req.model)
            if cyc.n_blocks:
                t.prefix_hit_ratio.observe(ticket.matched_blocks / cyc.n_blocks)
            if decision.pd is not None:
                verdict = decision.pd.verdict
                outcome = (
                    "disaggregated" if prefill else "no_prefill_endpoint" if verdict is None else "local"
                )
                t.pd_decisions.labels(outcome).inc()
        pick = Pick(req.request_id, chosen, ticket, label, ",".join(chosen))
        if prefill is not None:
            pick.prefill = prefill.key
        return pick, new_body

    def pick_bodiless(self, headers: Mapping[str, str], subset: Collection[str] | None = None) -> Pick:
        """A request with no body (GET /v1/models): any ready endpoint, no scheduling, index or
        accounting work."""
        rid = request_mod.request_id_of(headers)
        key = self.router.any_ready(subset).key
        return Pick(rid, [key], None, "bodiless", key)

    # -- after the pick -------------------------------------------------------------------------
    def served(self, pick: Pick, key: str | None, status: str) -> None:
        """The response began: ``key`` is the endpoint Envoy says served it (None: not told),
        ``status`` its HTTP status ("" unknown). A fallback that served gets the ticket."""
        ticket = pick.ticket
        if key and ticket is not None:
            primary = bool(pick.chosen) and key == pick.chosen[0]
            if self.telemetry is not None:
                (self.telemetry.served_primary if primary else self.telemetry.served_other).inc()
            if not primary and self.router.recredit(ticket, key):
                pick.chosen = [key, *(k for k in pick.chosen if k != key)]
                pick.destination = ",".join(pick.chosen)
        if status:
            pick.label = f"{pick.label}:{status[:1]}xx"

    def first_byte(self, pick: Pick) -> None:
        """A response body byte arrived (the prefill is done)."""
        if pick.ticket is not None:
            self.router.first_token(pick.ticket)

    def finish(self, pick: Pick, outcome: str) -> None:
        """End the accounting (idempotent) and count the request once: end of stream, error,
        reset or client disconnect. A bodiless pick has nothing to end and is not counted."""
        ticket = pick.ticket
        if ticket is not None and not ticket.done:
            self.router.finish(ticket)
            if self.telemetry is not None:
                self.telemetry.requests.labels(pick.label, outcome).inc()
            if self.flow is not None:
                self.flow.poke()

    def reject(self, outcome: str) -> None:
        """Count a request answered with an error before it had a ticket."""
        if self.telemetry is not None:
            self.telemetry.requests.labels("rejected", outcome).inc()

    # -- explain ----------------------------------------------------------------------------------
    async def explain(
        self, path: str, body: bytes, policy: str, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """Per-endpoint scores and TTFT estimates for one body, parsed and tokenized as a routed
        request is, without sending it anywhere (nothing is committed)."""
        if policy and policy not in self.router.profiles:
            raise BadRequest(f"unknown policy {policy!r}; known: {sorted(self.router.profiles)}")
        hdrs = {**headers, ":path": path or "/v1/completions"}
        req, _, _ = await self.prepare([body], len(body), hdrs)
        out = self.router.explain(req, policy or None)
        if self.flow is not None:
            out["flow_control"] = self.flow.explain(req)
        return out
