"""``bench.peer_messages`` end to end on a few messages: every kind is received over real ZMQ by the
picker's own code, woken per message and through the inbox, and accepted (a refused message fails
the loop measurement); ``--split`` prints every stage."""

from __future__ import annotations

import pytest

from bench.peer_messages import KINDS, _in_a_loop, measure, split


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_received_and_costed(kind: str) -> None:
    woken, inbox = measure(kind, 30, 8, 0.002), measure(kind, 30, 8, 0.002, interval_s=0.01)
    loop = _in_a_loop(kind, 30, 8)
    assert 0 < woken < 50 and 0 < inbox < 50 and 0 < loop < 50, (woken, inbox, loop)


def test_split_names_every_stage_with_a_cost() -> None:
    stages = dict(split(20, 8, 1))
    assert len(stages) == 8, stages
    assert stages["whole BlockStored, decoded and applied"] > 0, stages
