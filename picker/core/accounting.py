"""Request accounting: the one home of what the picker counts about requests it sent.

Per request a :class:`Ticket`; per endpoint a :class:`~picker.core.endpoints.types.Load` (``state.load``)::

    ticket = accounting.start(state, prompt_tokens, uncached_tokens, ...)  # in-flight += 1
    accounting.move(ticket, other_state, uncached_tokens)                  # Envoy served elsewhere
    accounting.first_token(ticket, measure)                                # prefill no longer pending
    accounting.finish(ticket)                                              # idempotent

Writers, one per field:

- ``Load.in_flight_requests``, ``in_flight_tokens``, ``pending_prefill_tokens``,
  ``pending_requests``: charged by
  :meth:`Accounting.start` (and :meth:`move`), released by :meth:`first_token` (pending prefill)
  and :meth:`finish`; nothing else writes them.
- ``Load.first_byte_rate``, ``first_byte_samples`` and :attr:`Accounting.first_byte_rate`: the
  per-request prefill cross-check, written by :meth:`first_token` from 2xx streamed responses
  only (``measure``). The cost scorer does not read them: it ranks on the calibrated model
  (``state.model``, written by :class:`picker.core.calibration.Calibrator` from scrapes), and the
  scraped metrics (``state.metrics``) are written by the scraper (or cluster mode's scrape).
- :class:`Ticket` fields: this module (``started``, ``first_token_at``, ``done``, the endpoint
  and its token counts on a move).

Invariant: every ``start`` is matched by exactly one effective ``finish`` (later calls are
no-ops), so the in-flight counters return to zero when traffic stops; they are never negative.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from picker.core.endpoints.types import EndpointState
from picker.core.scheduling.types import Cycle

MIN_MEASURED_TOKENS = 256
"""A first byte after fewer prefill tokens (its own and those queued ahead) is not a sample:
short prefills are dominated by fixed overheads."""


@dataclass(slots=True)
class Ticket:
    """One request's accounting, charged to ``state`` (the endpoint credited with it: the
    primary, until :meth:`Accounting.move` moves it to the endpoint Envoy says served it)."""

    state: EndpointState
    prompt_tokens: int
    uncached_tokens: int
    queued_tokens: int
    """Prefill tokens pending on ``state`` when the request was sent (ahead of it)."""
    started: float
    first_token_at: float = 0.0
    done: bool = False
    matched_blocks: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    cycle: Cycle | None = None
    """The cycle that picked: its matches price a re-credited endpoint's cached tokens."""
    hashes: Sequence[int] = ()
    """The request's block hashes (the list the index recorded; not a copy)."""


def _ewma(current: float, observed: float, alpha: float) -> float:
    """The first observation is taken as is (``current`` 0 means none yet)."""
    return observed if current <= 0 else (1 - alpha) * current + alpha * observed


class Accounting:
    def __init__(self, alpha: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha, self.clock = alpha, clock
        self.first_byte_rate = 0.0
        """Cross-check only: pool-wide per-request prefill tokens/s (EWMA over first bytes of 2xx
        streamed responses)."""

    def start(
        self,
        state: EndpointState,
        prompt_tokens: int,
        uncached_tokens: int,
        matched_blocks: int = 0,
        cycle: Cycle | None = None,
        hashes: Sequence[int] = (),
    ) -> Ticket:
        ticket = Ticket(
            state,
            prompt_tokens,
            uncached_tokens,
            state.load.pending_prefill_tokens,
            self.clock(),
            matched_blocks=matched_blocks,
            cycle=cycle,
            hashes=hashes,
        )
        self._charge(ticket)
        return ticket

    @staticmethod
    def _charge(ticket: Ticket) -> None:
        load = ticket.state.load
        load.in_flight_requests += 1
        load.in_flight_tokens += ticket.prompt_tokens
        if not ticket.first_token_at:
            load.pending_prefill_tokens += ticket.uncached_tokens
            load.pending_requests += 1

    @staticmethod
    def _discharge(ticket: Ticket) -> None:
        load, key = ticket.state.load, ticket.state.key
        if not ticket.first_token_at:
            load.pending_prefill_tokens = max(0, load.pending_prefill_tokens - ticket.uncached_tokens)
            load.pending_requests -= 1
        load.in_flight_requests -= 1
        load.in_flight_tokens -= ticket.prompt_tokens
        assert load.in_flight_requests >= 0, f"{key}: in-flight requests went negative"
        assert load.in_flight_tokens >= 0, f"{key}: in-flight tokens went negative"
        assert load.pending_requests >= 0, f"{key}: pending requests went negative"

    def move(self, ticket: Ticket, new: EndpointState, uncached_tokens: int, matched_blocks: int) -> None:
        """Re-credit a live ticket to ``new``: its in-flight counts and, if its prefill is still
        pending, its pending prefill move there."""
        assert not ticket.done, "a finished ticket cannot move"
        self._discharge(ticket)
        ticket.state = new
        ticket.matched_blocks = matched_blocks
        ticket.uncached_tokens = uncached_tokens
        ticket.queued_tokens = new.load.pending_prefill_tokens
        self._charge(ticket)

    def first_token(self, ticket: Ticket, measure: bool = True) -> None:
        """The first response byte: the request's prefill is no longer pending. With ``measure``
        (a 2xx streamed response only: an error or a whole non-streamed body says nothing about
        prefill speed) the time also feeds the cross-check rate."""
        if ticket.done or ticket.first_token_at:
            return
        now = self.clock()
        ticket.first_token_at = now
        load = ticket.state.load
        load.pending_prefill_tokens = max(0, load.pending_prefill_tokens - ticket.uncached_tokens)
        load.pending_requests -= 1
        elapsed = now - ticket.started
        work = ticket.uncached_tokens + ticket.queued_tokens
        if measure and elapsed > 0 and work >= MIN_MEASURED_TOKENS:
            observed = work / elapsed
            load.first_byte_rate = _ewma(load.first_byte_rate, observed, self.alpha)
            load.first_byte_samples += 1
            self.first_byte_rate = _ewma(self.first_byte_rate, observed, self.alpha)

    def finish(self, ticket: Ticket) -> None:
        """End, error, reset or disconnect; idempotent."""
        if ticket.done:
            return
        ticket.done = True
        self._discharge(ticket)
