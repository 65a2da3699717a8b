"""The release rule of a request's pending prefill (``picker.core.accounting``): at its predicted
end, unless the engine's first-token count, scraped after a prediction came due, says the engine
is behind; then at the first scrape whose count reaches it, or at its hold limit."""

from __future__ import annotations

from picker.core.accounting import HOLD_LIMIT, Accounting, Ticket
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointState


def scraped(
    acc: Accounting, s: EndpointState, t: float, first_tokens: float, waiting: float, running: float
) -> None:
    s.metrics = EndpointMetrics(
        waiting=waiting, running=running, first_tokens_total=first_tokens, updated_at=t
    )
    acc.reconcile(s)


def two_requests(first_tokens: float) -> tuple[list[float], Accounting, EndpointState, list[Ticket]]:
    """An engine that has served 7 requests before (its count's baseline), then two of ours, 500
    uncached tokens each at 1,000 tokens/s: predicted done at 0.51 s and 1.01 s."""
    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    s = EndpointState(Endpoint("10.0.0.1", 1))
    s.model.prefill_rate, s.model.step_base_s, s.model.step_per_seq_s = 1000.0, 0.01, 0.0
    scraped(acc, s, 0.0, first_tokens, 0, 0)  # nothing of ours in flight: sets the baseline
    tickets = [acc.start(s, 600, 500), acc.start(s, 600, 500)]
    assert [t.due for t in tickets] == [0.51, 1.01] and [t.seq for t in tickets] == [1, 2]
    return now, acc, s, tickets


def test_a_prefill_the_engine_has_not_counted_stays_pending_past_its_predicted_end() -> None:
    now, acc, s, (t1, t2) = two_requests(7)
    now[0] = 0.55
    acc.expire([s])
    assert not t1.pending, "no scrape has said the engine is behind: released at its predicted end"
    now[0] = 0.6
    scraped(acc, s, 0.6, 7, waiting=1, running=1)  # t1 came due, but its first token is not counted
    assert s.load.first_tokens_seen == 0 and s.load.first_tokens_behind
    now[0] = 1.05
    acc.expire([s])
    assert t2.pending and s.load.pending_prefill_tokens == 500, "the engine is behind: t2 is held"
    now[0] = 1.1
    scraped(acc, s, 1.1, 8, waiting=0, running=2)  # t1's first token counted, not yet t2's
    assert t2.pending
    now[0] = 1.3
    scraped(acc, s, 1.3, 9, waiting=0, running=2)  # t2's first token counted
    assert not t2.pending and s.load.pending_requests == 0 and s.load.pending_prefill_tokens == 0
    for t in (t1, t2):
        acc.finish(t)
    assert (s.load.in_flight_requests, len(s.load.prefill_due)) == (0, 0)


def test_a_hold_ends_at_its_limit() -> None:
    """A count that never reaches the request (rejected before the engine counted it): released
    ``HOLD_LIMIT`` times its predicted time after its predicted end."""
    now, acc, s, (_, t2) = two_requests(7)
    now[0] = 0.6
    scraped(acc, s, 0.6, 7, waiting=1, running=1)
    limit = t2.due + HOLD_LIMIT * (t2.due - t2.started)
    now[0] = limit - 0.01
    acc.expire([s])
    assert t2.pending
    now[0] = limit
    acc.expire([s])
    assert not t2.pending and s.load.pending_requests == 0


def test_without_a_count_the_prediction_alone_releases() -> None:
    """A page without ``vllm:time_to_first_token_seconds`` (first_tokens_total -1): as before the
    count was read."""
    now, acc, s, (t1, t2) = two_requests(-1)
    now[0] = 0.6
    scraped(acc, s, 0.6, -1, waiting=1, running=1)
    assert s.load.first_tokens_seen == -1 and not s.load.first_tokens_behind
    now[0] = 1.05
    acc.expire([s])
    assert not t1.pending and not t2.pending


def test_a_count_that_goes_back_is_an_engine_restart_and_is_not_trusted() -> None:
    now, acc, s, (_, t2) = two_requests(7)
    now[0] = 0.6
    scraped(acc, s, 0.6, 0, waiting=1, running=1)  # the engine restarted: its count starts over
    assert s.load.first_tokens_seen == -1 and s.load.first_tokens_baseline is None
    now[0] = 1.05
    acc.expire([s])
    assert not t2.pending, "no trusted count: released at its predicted end"
