"""Request accounting: the one home of what the picker counts about requests it sent.

Per request a :class:`Ticket`; per endpoint a :class:`~picker.core.endpoints.types.Load` (``state.load``)::

    ticket = accounting.start(state, prompt_tokens, uncached_tokens, ...)  # in-flight += 1
    accounting.move(ticket, other_state, uncached_tokens)                  # Envoy served elsewhere
    accounting.expire(states)                # prefills predicted done by now: no longer pending
    accounting.reconcile(state)              # after a scrape: at most waiting + 1 still pending
    accounting.first_token(ticket)           # a first response byte (when Envoy sends bodies)
    accounting.finish(ticket)                # idempotent

**When a prefill stops being pending.** The shipped Envoy configs send the picker no response
bodies, so it never sees a first byte; releasing the pending prefill only at the end of the
stream would count a replica serving long streams as queued for as long as they decode. A
request's prefill is released by whichever comes first:

- its predicted end (:attr:`Ticket.due`): the endpoint works through the prefills we sent in
  order, so ``due = max(now, busy_until) + uncached / rate + step(running)``, with the
  calibrated model (``state.model``) at send time, and ``busy_until`` advanced by the request's
  ``uncached / rate``;
- the scraped queue (:meth:`reconcile`): vLLM admits in arrival order (FCFS), so once a scrape
  shows ``W`` requests waiting, at most ``W + 1`` of those we sent before it (the ``+ 1``: one
  being prefilled in the current step, if any runs) can still be pending; the older ones are
  released. While the endpoint's prefill rate is still the uncalibrated prior
  (``state.model.prefill_source == "default"``: the pool has measured no prefill yet), the
  ones still pending are then re-timed from the scrape (:meth:`reconcile`, only ever
  earlier): in send order, ``busy`` from now plus each one's ``uncached / rate``,
  ``due = min(due, busy + step(running))``, and ``busy_until`` lowered to ``busy``. With the
  prior rate the predicted ends can run seconds late; the scrape has just shown how far the
  endpoint got, so the work behind it is timed from there. Once the rate is measured the
  predictions stand (re-timing them then cost hit rate in approximate mode).
  Requests of ours that the engine counts neither running nor waiting, and has not counted as
  finished either (``vllm:request_success_total``), have not reached it (an API server starved
  of CPU held 30 for 10 s on the shared machine while its engine sat idle): they are counted as
  ``Load.unseen_requests``, queued work the gauges do not show. (Without response bodies a
  finished request's stream can also stay open at Envoy for seconds; the engine's finished
  count tells the two apart: those are ``Load.finished_streams``, not load.);
- a first response byte, when Envoy sends response bodies;
- the end of the request.

**Both pods of a disaggregated request** (:mod:`picker.core.scheduling.pd`). The request is
charged to its decode pod as any request is, with no uncached tokens: the decode pod computes
none of the prompt, its KV arrives over the link. Its prefill is charged to the prefill pod as a
second ticket, a *leg* (:meth:`start` with ``leg=True``, linked from the request's ticket as
:attr:`Ticket.leg`): in flight there, its uncached tokens pending, from the pick until the
prefill is predicted done (``due``, the same rule as above). The decode pod's sidecar calls the
prefiller directly, not through Envoy, so no response path ever reports on the leg; at its
predicted end (:meth:`expire`) the leg is finished outright, not only released, and the prefill
pod's next scrape corrects the prediction both ways: a leg still waiting there shows in the
scraped ``waiting`` gauge (priced by the cost scorer), and a scrape that shows it no longer
waiting releases and finishes it early (:meth:`reconcile`). The request's end, or its first
byte, also ends its leg (the prefill was done before the decode began).

A prediction that comes too early is corrected by the cost scorer: a released request still
waiting in the replica's queue shows in the scraped ``waiting`` gauge, which it prices (less our
pending requests) at the endpoint's uncached tokens per request.

Writers, one per field:

- ``Load.in_flight_requests``, ``in_flight_tokens``, ``pending_prefill_tokens``,
  ``pending_requests``, ``prefill_busy_until``, ``prefill_due``, ``unseen_requests``, ``finished_streams``, ``sent_total``, ``seen_baseline``: charged by :meth:`Accounting.start`
  (and :meth:`move`), pending prefill released by :meth:`expire`, :meth:`reconcile` and
  :meth:`first_token`, ``prefill_busy_until`` also lowered by :meth:`reconcile`, everything
  by :meth:`finish`; nothing else writes them.
- Not here: the cost scorer ranks on the calibrated model (``state.model``, written by
  :class:`picker.core.calibration.Calibrator` from scrapes) and the scraped metrics
  (``state.metrics``, written by the scraper or cluster mode's scrape); no response timing
  feeds either.
- :class:`Ticket` fields: this module (``started``, ``due`` (set by :meth:`Accounting.start`
  and :meth:`move`, lowered by :meth:`reconcile`), ``pending``, ``done``, the endpoint and its
  token counts on a move).

Invariant: every ``start`` is matched by exactly one effective ``finish`` (later calls are
no-ops), so the in-flight counters return to zero when traffic stops; they are never negative.
``unseen_requests + finished_streams <= in_flight_requests``: :meth:`reconcile` splits our
requests in flight at a scrape, and an ending request takes its share of that split with it at
once (an open stream's first), not at the next scrape: a request that has ended is never queued
work on its endpoint, so the next prompt of a client sending one after another sees the prefix's
holder as it is.
A ticket's pending prefill is released at most once (``Ticket.pending``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from picker.core.endpoints.types import EndpointState
from picker.core.scheduling.types import Cycle

RECONCILE_GRACE_S = 0.05
"""Requests sent less than this before a scrape are left out of :meth:`Accounting.reconcile`:
vLLM updates its queue gauges once per engine step, so a request that has just arrived may not
be in the scraped ``waiting`` yet."""


@dataclass(slots=True)
class Ticket:
    """One request's accounting, charged to ``state`` (the endpoint credited with it: the
    primary, until :meth:`Accounting.move` moves it to the endpoint Envoy says served it)."""

    state: EndpointState
    prompt_tokens: int
    uncached_tokens: int
    started: float
    due: float = 0.0
    """Predicted end of its prefill on ``state`` (the module docstring)."""
    pending: bool = True
    """Its uncached tokens are still counted in ``state.load.pending_prefill_tokens``."""
    done: bool = False
    matched_blocks: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    cycle: Cycle | None = None
    """The cycle that picked: its matches price a re-credited endpoint's cached tokens. None
    once the ticket is done (:meth:`Accounting.finish`)."""
    hashes: Sequence[int] = ()
    """The request's block hashes (the list the index recorded; not a copy). Empty once done."""
    leg: Ticket | None = None
    """A disaggregated request's prefill leg on its prefill pod (the module doc), else None."""
    is_leg: bool = False
    """This ticket is a prefill leg: finished at its predicted prefill end, never moved."""


class Accounting:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock

    def start(
        self,
        state: EndpointState,
        prompt_tokens: int,
        uncached_tokens: int,
        matched_blocks: int = 0,
        cycle: Cycle | None = None,
        hashes: Sequence[int] = (),
        leg: bool = False,
    ) -> Ticket:
        """Charge a request to ``state``; with ``leg``, a disaggregated request's prefill leg
        (link it as the request ticket's :attr:`Ticket.leg`)."""
        ticket = Ticket(
            state,
            prompt_tokens,
            uncached_tokens,
            self.clock(),
            matched_blocks=matched_blocks,
            cycle=None if leg else cycle,
            hashes=() if leg else hashes,
            is_leg=leg,
        )
        self._charge(ticket)
        return ticket

    def _charge(self, ticket: Ticket) -> None:
        load, model = ticket.state.load, ticket.state.model
        if ticket.pending:
            now = self.clock()
            running = load.in_flight_requests
            load.prefill_busy_until = (
                max(now, load.prefill_busy_until) + ticket.uncached_tokens / model.prefill_rate
            )
            ticket.due = load.prefill_busy_until + model.step_s(running)
            load.prefill_due.append(ticket)
            load.pending_prefill_tokens += ticket.uncached_tokens
            load.pending_requests += 1
        load.in_flight_requests += 1
        load.in_flight_tokens += ticket.prompt_tokens
        load.sent_total += 1

    @staticmethod
    def _release(ticket: Ticket) -> None:
        """The ticket's prefill is no longer pending (at most once)."""
        if not ticket.pending:
            return
        ticket.pending = False
        load = ticket.state.load
        load.pending_prefill_tokens = max(0, load.pending_prefill_tokens - ticket.uncached_tokens)
        load.pending_requests -= 1
        assert load.pending_requests >= 0, f"{ticket.state.key}: pending requests went negative"

    def _discharge(self, ticket: Ticket) -> None:
        load, key = ticket.state.load, ticket.state.key
        self._release(ticket)
        load.in_flight_requests -= 1
        load.in_flight_tokens -= ticket.prompt_tokens
        assert load.in_flight_requests >= 0, f"{key}: in-flight requests went negative"
        assert load.in_flight_tokens >= 0, f"{key}: in-flight tokens went negative"
        # The last scrape's split of our requests in flight no longer fits: the ended one was
        # among them. It most likely finished in the engine (its stream closed after), so an
        # open stream goes first; a request no longer in flight is never unseen work.
        excess = load.finished_streams + load.unseen_requests - load.in_flight_requests
        if excess > 0:
            closed = min(excess, load.finished_streams)
            load.finished_streams -= closed
            load.unseen_requests -= excess - closed

    def move(self, ticket: Ticket, new: EndpointState, uncached_tokens: int, matched_blocks: int) -> None:
        """Re-credit a live ticket to ``new``: its in-flight counts and, if its prefill is still
        pending, its pending prefill move there."""
        assert not ticket.done, "a finished ticket cannot move"
        assert not ticket.is_leg, "a prefill leg stays on its prefill pod"
        pending = ticket.pending
        self._discharge(ticket)
        ticket.state.load.sent_total -= 1  # it never reached the primary
        ticket.state = new
        ticket.matched_blocks = matched_blocks
        ticket.uncached_tokens = uncached_tokens
        ticket.pending = pending
        self._charge(ticket)

    def expire(self, states: Iterable[EndpointState]) -> None:
        """Release the pending prefills predicted done by now (``Ticket.due``) on ``states``.
        Amortised O(1) per ticket: each is appended and popped once."""
        now = self.clock()
        for state in states:
            due = state.load.prefill_due
            while due and due[0].due <= now:
                ticket = due.popleft()
                if ticket.is_leg:  # its prefill is predicted done: the leg is over
                    self.finish(ticket)
                elif ticket.state is state:  # else moved: its entry on the new endpoint counts
                    self._release(ticket)

    def reconcile(self, state: EndpointState) -> None:
        """After a scrape: of the requests sent at least :data:`RECONCILE_GRACE_S` before it, at
        most ``waiting + 1`` (+ 0 with nothing running) can still be in prefill (FCFS
        admission), with those the engine has not seen at all; release the older ones.
        Those the engine counts neither running nor waiting are ``Load.unseen_requests``. Then,
        while ``state.model`` is still the uncalibrated prior, re-time those still pending from
        now (:meth:`_retime`)."""
        load, m = state.load, state.metrics
        due = load.prefill_due
        cutoff = m.updated_at - RECONCILE_GRACE_S
        live = [t for t in due if not t.done and t.state is state]
        recent = sum(1 for t in live if t.started > cutoff)
        seen = m.request_success_total + m.running + m.waiting
        if load.in_flight_requests == 0:
            load.seen_baseline = load.sent_total - seen
        # Ours in flight that the engine shows neither running nor waiting, but only as many as
        # it has not seen at all: the rest have finished there, their streams not yet closed.
        not_in_engine = load.in_flight_requests - recent - int(m.running + m.waiting)
        never_seen = load.sent_total - recent - seen - load.seen_baseline
        load.unseen_requests = max(0, min(not_in_engine, int(never_seen)))
        load.finished_streams = max(0, not_in_engine - load.unseen_requests)
        before = [t for t in live if t.pending and t.started <= cutoff]
        keep = int(m.waiting) + min(1, int(m.running)) + load.unseen_requests
        for ticket in before[: max(0, len(before) - keep)]:
            if ticket.is_leg:  # no longer waiting there: its prefill is done or running
                self.finish(ticket)
            else:
                self._release(ticket)
        while due and not (due[0].pending and due[0].state is state):
            due.popleft()
        if state.model.prefill_source == "default":
            self._retime(state)

    def _retime(self, state: EndpointState) -> None:
        """Re-time the prefills still pending on ``state`` from now (called by :meth:`reconcile`,
        after its releases): the scrape has shown the older ones done, so the endpoint is
        working through these now. Walking them in send order, ``busy`` starts at now and
        advances by each one's ``uncached / rate`` (seconds, ``state.model.prefill_rate`` in
        tokens/s); its :attr:`Ticket.due` becomes ``min(due, busy + step(running))`` and
        ``Load.prefill_busy_until`` becomes ``min(busy_until, busy)``. Only ever earlier: a
        prediction made with a slow (uncalibrated) rate runs away by seconds, and without this
        the scrape rule alone released the work queued behind it. Dues stay in send order (the
        element-wise minimum of two non-decreasing sequences), as :meth:`expire` needs."""
        load, model = state.load, state.model
        busy = self.clock()
        step = model.step_s(load.in_flight_requests)
        for ticket in load.prefill_due:
            if ticket.pending and not ticket.done and ticket.state is state:
                busy += ticket.uncached_tokens / model.prefill_rate
                ticket.due = min(ticket.due, busy + step)
        load.prefill_busy_until = min(load.prefill_busy_until, busy)

    def first_token(self, ticket: Ticket) -> None:
        """A response byte: the request's prefill is no longer pending (a no-op after the first,
        or once finished)."""
        if not ticket.done:
            self._release(ticket)
            if ticket.leg is not None:
                self.finish(ticket.leg)

    def finish(self, ticket: Ticket) -> None:
        """End, error, reset or disconnect; idempotent. The finished ticket lets go of its cycle
        and block hashes: it can stay queued in ``Load.prefill_due`` until its predicted end or
        the next scrape, and must not keep the request's routing text (up to ``max_blocks ×
        block_size`` bytes) and hashes alive there. Held, they made the picker's heap grow and
        shrink by that much per request: fresh pages, zeroed by the kernel, on every large body."""
        if ticket.done:
            return
        ticket.done = True
        self._discharge(ticket)
        ticket.cycle, ticket.hashes = None, ()
        if ticket.leg is not None:
            self.finish(ticket.leg)
