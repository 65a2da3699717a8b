"""``python -m bench.looplag OUT [picker args]``: the picker, with its event loop's lag recorded.

A bench-only wrapper (the picker itself carries no such probe): it runs ``python -m picker`` with
the given arguments, plus one task on the picker's event loop that sleeps ``TICK_S`` at a time and
appends to ``OUT`` every wake-up that came more than ``RECORD_OVER_S`` late, as one line
``monotonic_start lag_ms main_thread_cpu_ms process_cpu_ms``. ``time.monotonic`` is one clock for
every process on the machine, so a client can line its own timings up with these lines.

Reading a line: lag with as much main-thread CPU is a long step on the loop (a handler, gRPC's
completion-queue drain); lag with little CPU is time the picker spent waiting for a core (or for
the GIL) while nothing ran on its loop.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from typing import Any, TextIO

TICK_S = 0.001
RECORD_OVER_S = 0.002


async def watch(out: TextIO) -> None:
    """Record the loop's late wake-ups into ``out`` until cancelled."""
    last, thread, proc = time.monotonic(), time.thread_time(), time.process_time()
    while True:
        await asyncio.sleep(TICK_S)
        now, t, p = time.monotonic(), time.thread_time(), time.process_time()
        if now - last - TICK_S > RECORD_OVER_S:
            out.write(
                f"{last:.6f} {(now - last) * 1e3:.2f} {(t - thread) * 1e3:.2f} {(p - proc) * 1e3:.2f}\n"
            )
            out.flush()
        last, thread, proc = now, t, p


def read(path: str) -> list[tuple[float, float, float, float]]:
    """``OUT``'s lines as (start, lag ms, main-thread CPU ms, process CPU ms)."""
    with open(path, encoding="utf-8") as fh:
        rows = [tuple(float(x) for x in line.split()) for line in fh if line.strip()]
    return [(r[0], r[1], r[2], r[3]) for r in rows if len(r) == 4]


def main() -> int:
    out_path, picker_args = sys.argv[1], sys.argv[2:]
    run = asyncio.run

    def run_watched(main: Coroutine[Any, Any, Any], **kw: Any) -> Any:
        async def watched() -> Any:
            with open(out_path, "a", encoding="utf-8") as out:
                task = asyncio.create_task(watch(out))
                try:
                    return await main
                finally:
                    task.cancel()

        return run(watched(), **kw)

    asyncio.run = run_watched  # the picker's one asyncio.run
    from picker.__main__ import main as picker_main

    return picker_main(picker_args)


if __name__ == "__main__":
    raise SystemExit(main())
