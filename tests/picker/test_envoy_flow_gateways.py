"""Flow control's hold through a real Envoy configured as the chart's gateways configure theirs
(docs/flow-control.md, "Default"): none of them sets ``max_message_timeout``, so Envoy ignores the
picker's ``override_message_timeout``.

- With a ``FULL_DUPLEX_STREAMED`` request body (Istio's, Envoy AI Gateway's default, kgateway's)
  Envoy starts no message timer: a held request outlives the message timeout.
- With a ``BUFFERED`` body the message timeout cuts a hold longer than it (Envoy's 504; the picker
  counts the stream ``cancelled``) — unless the queue's TTL is below the gateway's message timeout:
  then the picker answers first, a 429 to a sheddable request and the replica's answer to another.

Saturation as in test_envoy_flow.py: the fake upstreams report 500 waiting requests."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator

import pytest

from kvlaunch import Stack, stack
from tests.picker.test_envoy_flow import metric, saturate, send, wait_for

pytestmark = pytest.mark.envoy


def _stack(tmp: pathlib.Path, ttl_s: float, *envoy_args: str) -> Iterator[Stack]:
    cfg = tmp / "picker.yaml"
    cfg.write_text(
        json.dumps({"objectives": {"batch": -1}, "flowControl": {"enabled": True, "ttl_s": ttl_s}})
    )
    picker_args = ("--config-file", str(cfg), "--scrape-interval", "0.05")
    with stack(tmp, picker_args=picker_args, envoy_args=envoy_args) as st:
        yield st


@pytest.fixture
def duplex(tmp_path: pathlib.Path) -> Iterator[Stack]:
    """FULL_DUPLEX_STREAMED request bodies, a 1 s message timeout Envoy may not extend."""
    yield from _stack(
        tmp_path,
        30.0,
        "--body-mode",
        "FULL_DUPLEX_STREAMED",
        "--message-timeout",
        "1s",
        "--max-message-timeout",
        "1s",
    )


@pytest.fixture
def buffered_long_ttl(tmp_path: pathlib.Path) -> Iterator[Stack]:
    """BUFFERED bodies, a 1 s message timeout Envoy may not extend, the queue TTL 30 s."""
    yield from _stack(tmp_path, 30.0, "--message-timeout", "1s", "--max-message-timeout", "1s")


@pytest.fixture
def buffered_short_ttl(tmp_path: pathlib.Path) -> Iterator[Stack]:
    """BUFFERED bodies, a 3 s message timeout Envoy may not extend, the queue TTL 1 s under it."""
    yield from _stack(tmp_path, 1.0, "--message-timeout", "3s", "--max-message-timeout", "3s")


def test_full_duplex_hold_outlives_the_message_timeout(duplex: Stack) -> None:
    st = duplex
    before = metric(st, "flow_control_requests_total", outcome="dispatched")  # the routable probes
    saturate(st, True)
    got: list[tuple[int, bytes, dict[str, str]]] = []
    t = send(st, got)
    wait_for(lambda: metric(st, "flow_control_queue_size") == 1)
    time.sleep(2.5)  # 2.5 × the message timeout, which Envoy was not allowed to extend
    assert not got and t.is_alive(), f"answered while saturated: {got}"
    saturate(st, False)
    t.join(timeout=15)
    [(status, body, _)] = got
    assert status == 200, body
    assert metric(st, "flow_control_requests_total", outcome="dispatched") == before + 1
    assert metric(st, "flow_control_queue_size") == 0


def test_buffered_hold_is_cut_at_the_message_timeout(buffered_long_ttl: Stack) -> None:
    st = buffered_long_ttl
    saturate(st, True)
    got: list[tuple[int, bytes, dict[str, str]]] = []
    start = time.monotonic()
    send(st, got).join(timeout=15)
    waited = time.monotonic() - start
    [(status, body, _)] = got
    assert status == 504, body  # Envoy's own answer at its message timeout, not the picker's
    assert waited < 5, f"cut after {waited:.1f} s"
    wait_for(lambda: metric(st, "flow_control_queue_size") == 0)
    assert metric(st, "flow_control_requests_total", outcome="cancelled") == 1


def test_ttl_under_the_message_timeout_answers_before_envoy_cuts(buffered_short_ttl: Stack) -> None:
    st = buffered_short_ttl
    saturate(st, True)
    got: list[tuple[int, bytes, dict[str, str]]] = []
    shed: list[tuple[int, bytes, dict[str, str]]] = []
    a, b = send(st, got), send(st, shed, {"x-llm-d-inference-objective": "batch"})
    a.join(timeout=15)
    b.join(timeout=15)
    [(status, body, _)] = got
    assert status == 200, body  # not sheddable: sent on to a replica at its TTL
    [(status, body, headers)] = shed
    assert status == 429, body
    assert json.loads(body)["error"]["code"] == 429 and int(headers["retry-after"]) >= 1
    assert metric(st, "flow_control_requests_total", outcome="dispatched_ttl", priority="0") == 1
    assert metric(st, "flow_control_requests_total", outcome="evicted_ttl", priority="-1") == 1
    assert metric(st, "flow_control_queue_size") == 0
