"""``bench.looplag``'s record tells a long step on the loop (its CPU is the loop's) from a loop
that waited without running (little CPU): what ``bench.parse_stall`` reads it for."""

from __future__ import annotations

import asyncio
import pathlib
import time

import pytest

from bench import looplag


async def _blocked(out: pathlib.Path) -> None:
    with open(out, "w", encoding="utf-8") as fh:
        task = asyncio.create_task(looplag.watch(fh))
        await asyncio.sleep(0.05)
        end = time.thread_time() + 0.04
        while time.thread_time() < end:  # a 40 ms step that runs on the loop's thread
            pass
        await asyncio.sleep(0.05)
        time.sleep(0.04)  # a 40 ms step that does not run (as if waiting for a core)
        await asyncio.sleep(0.05)
        task.cancel()


@pytest.mark.timeout(30)
def test_a_busy_step_and_a_wait_are_recorded_apart(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "lag.txt"
    asyncio.run(_blocked(out))
    rows = [r for r in looplag.read(str(out)) if r[1] >= 35]
    busy = [r for r in rows if r[2] >= 35]
    idle = [r for r in rows if r[2] < 10]
    assert busy and idle, rows
    assert busy[0][0] < idle[0][0], "the busy step came first"
    assert all(r[3] >= r[2] - 0.5 for r in rows), "the process's CPU includes the main thread's"
