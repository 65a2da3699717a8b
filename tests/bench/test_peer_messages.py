"""``bench.peer_messages`` end to end on a few messages: every kind is received over real ZMQ by the
picker's own code and accepted (a refused message fails the loop measurement)."""

from __future__ import annotations

import pytest

from bench.peer_messages import KINDS, measure


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_received_and_costed(kind: str) -> None:
    woken, loop = measure(kind, 30, 8, 0.002)
    assert 0 < woken < 50 and 0 < loop < 50, (woken, loop)
