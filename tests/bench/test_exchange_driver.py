"""bench.exchange drives the real ExtProcService in a child process and reports its cost."""

from __future__ import annotations

from bench.exchange import SIZES, run_once


def test_the_driver_runs_this_checkouts_picker() -> None:
    us = run_once("", SIZES["8k"], 50)
    assert 1.0 < us < 100_000.0, f"{us} us per request"
