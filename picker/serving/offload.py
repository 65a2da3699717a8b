"""Parsing of large request bodies off the event loop, in a worker process.

orjson holds the GIL while it decodes, so a thread would stall the loop just the same. What a
large body costs the other requests, offloaded and inline side by side, is measured by
``python -m bench.parse_stall`` (figures in bench/results/parse_stall.md). Bodies
of at least ``threshold`` bytes go to one spawned worker process (spawned, not forked: the
picker's gRPC threads must not be forked); smaller ones, and every body when the worker is
broken, are parsed inline. What comes back is small: the request with its routing text already
cut to what the hasher reads, and the rewritten body only when a trusted rewrite changed it.

The worker runs at a lower CPU priority (``WORKER_NICE``): where cores are scarce, the event loop
that serves every other request preempts it, and the large body's own parse waits instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import resource_tracker

from picker.core.request import Parsed, ParseOptions, parse_and_rewrite

log = logging.getLogger(__name__)


class BodyParser:
    """Owns the worker process; used only from the event loop's thread."""

    def __init__(self, threshold: int, workers: int = 1) -> None:
        assert threshold >= 0 and workers >= 1, f"bad offload settings {threshold=} {workers=}"
        self.threshold, self.workers = threshold, workers
        self._pool: ProcessPoolExecutor | None = None

    def offloads(self, size: int) -> bool:
        return 0 < self.threshold <= size

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=ctx, initializer=_die_with_parent, initargs=(os.getpid(),)
            )
        return self._pool

    def start(self) -> None:
        """Spawn the worker now, not on the first large body. Returns at once: the worker's
        imports (about a second) run in the worker, not in the picker's startup."""
        if self.threshold:
            self._executor().submit(_warm)

    async def parse(
        self, chunks: Sequence[bytes], path: str, headers: Mapping[str, str], opts: ParseOptions
    ) -> Parsed:
        """:func:`~picker.core.request.parse_and_rewrite` of the joined ``chunks`` in the worker
        (the join happens there too); raises what it raises."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor(), _parse_chunks, list(chunks), path, dict(headers), opts
            )
        except BrokenProcessPool:
            log.warning("body parser worker died; parsing inline and starting a new one")
            self.close()
            return _parse_chunks(chunks, path, headers, opts)

    def close(self, wait: bool = False) -> None:
        """Stop the worker; ``wait`` joins it (at exit: no process outlives the picker)."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None
            if wait:  # spawn's resource tracker would otherwise outlive us by a moment
                stop = getattr(resource_tracker._resource_tracker, "_stop", None)
                if stop is not None:
                    stop()


def _parse_chunks(
    chunks: Sequence[bytes], path: str, headers: Mapping[str, str], opts: ParseOptions
) -> Parsed:
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return parse_and_rewrite(body, path, headers, opts)


_PR_SET_PDEATHSIG = 1
WORKER_NICE = 10
"""Added to the worker's nice value: the picker's event loop wins the CPU over a large parse."""


def _die_with_parent(parent: int) -> None:
    """Runs first in the worker: it lowers its CPU priority, and it dies with the picker however the picker ends. A SIGKILLed
    picker (OOM kill, ``kill -9``) otherwise leaves the worker, and spawn's resource tracker
    whose pipe the worker holds, running for ever. The pool spawns from the event loop's thread,
    which lives as long as the picker, so the death signal fires only when the picker exits."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the picker died before the death signal was armed
        os._exit(0)
    os.nice(WORKER_NICE)


def _warm() -> None:
    """Runs in the worker: importing this module imported everything parsing needs."""
