"""bench.balance: each pick against what was in flight on each replica when it was sent."""

from __future__ import annotations

import json
import pathlib

from bench.balance import Request, classify, report


def _r(index: int, sent: float, replica: int, ttft: float = 0.03, e2e: float = 0.06) -> Request:
    return Request(index, sent, ttft, e2e, replica, ttft - 0.005)


def test_picks_are_classed_by_prefilling_then_decoding_requests() -> None:
    window = [
        _r(0, 0.000, 0),  # nothing in flight: same
        _r(1, 0.010, 0),  # 0 is prefilling request 0: more-prefilling
        _r(2, 0.020, 1),  # 0 prefills two: fewer-prefilling
        _r(3, 0.055, 0),  # none prefilling; 0 decodes two, 1 one: more-decoding
        _r(4, 0.200, 1),  # all done: same
    ]
    kinds = [k for _, k in classify(window)]
    assert kinds == ["same", "more-prefilling", "fewer-prefilling", "more-decoding", "same"]
    assert classify([_r(0, 0.0, 0), _r(1, 0.045, 1)])[1][1] == "fewer-decoding"


def test_report_reads_a_run_directory(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "r0" / "cost"
    d.mkdir(parents=True)
    outcomes = [
        {"index": 0, "ok": True, "sent_at": 0.0, "ttft": 0.03, "e2e": 0.06},
        {"index": 1, "ok": True, "sent_at": 0.01, "ttft": 0.05, "e2e": 0.08},
        {"index": 2, "ok": False, "sent_at": 0.02, "ttft": 0.0, "e2e": 0.0},
    ]
    split = [{"index": 0, "replica": 0, "engine": 0.025}, {"index": 1, "replica": 0, "engine": 0.045}]
    (d / "no-sharing@nice19.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outcomes))
    (d / "no-sharing@nice19.split.jsonl").write_text("".join(json.dumps(s) + "\n" for s in split))
    text = report(tmp_path, "no-sharing@nice19")
    assert "| cost | 1; 30 / 25 | 0 | 1; 50 / 45 | 0 | 0 |" in text, text
