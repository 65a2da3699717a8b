"""The simulated engine: one step is schedule → step time from the cost model → apply.

``EngineCore`` owns the block pool and the scheduler and knows nothing about clocks: ``begin``
schedules a step and says how long it takes; ``end`` applies it at the time the driver says.
Two drivers advance time: ``AsyncEngine`` (here) sleeps in real time for the HTTP server, and
``bench.cluster`` runs many cores in discrete-event time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .blocks import BlockPool, Event
from .costmodel import Profile
from .request import Request
from .scheduler import Batch, Scheduler, SchedulerConfig
from .stats import EngineStats


@dataclass
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0  # 0: derived from the profile
    time_scale: float = 1.0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(slots=True)
class Step:
    batch: Batch
    duration: float


class EngineCore:
    def __init__(
        self, profile: Profile, cfg: EngineConfig, on_events: Callable[[list[Event]], None] | None = None
    ) -> None:
        self.profile, self.cfg = profile, cfg
        blocks = cfg.num_gpu_blocks or profile.num_gpu_blocks(cfg.block_size)
        self.pool = BlockPool(blocks, cfg.block_size, record_events=on_events is not None)
        self.sched = Scheduler(self.pool, cfg.scheduler)
        self.on_events = on_events
        self.stats = EngineStats()
        self.max_model_len = (blocks - 1) * cfg.block_size

    def begin(self, now: float) -> Step | None:
        batch = self.sched.schedule(now)
        if not batch:
            return None
        self.stats.begin(now)
        work = [self.sched.computed_part(r, n) for r, n in batch]
        duration = self.profile.step_time(work) * self.cfg.time_scale
        return Step(batch, duration)

    def end(self, step: Step, now: float) -> list[Request]:
        """Apply a step at ``now``; returns the requests that sampled a token."""
        produced = self.sched.update(step.batch, now)
        self.stats.on_step(step.batch, produced, now)
        if self.on_events is not None:
            events = self.pool.take_events()
            if events:
                self.on_events(events)
        return produced


class AsyncEngine:
    """Real-time driver: each request gets an asyncio.Queue fed with its output count per token."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.queues: dict[int, asyncio.Queue[int]] = {}
        self._wake = asyncio.Event()
        self._thawed = asyncio.Event()
        self._thawed.set()

    @property
    def frozen(self) -> bool:
        return not self._thawed.is_set()

    def freeze(self, frozen: bool) -> None:
        """A fault for tests: a frozen engine takes no step (a hung GPU) while the HTTP server,
        /metrics included, keeps answering; requests wait until it thaws."""
        if frozen:
            self._thawed.clear()
        else:
            self._thawed.set()

    def submit(self, req: Request) -> asyncio.Queue[int]:
        req.arrival = time.monotonic()
        q: asyncio.Queue[int] = asyncio.Queue()
        self.queues[req.request_id] = q
        self.core.sched.add(req)
        self._wake.set()
        return q

    def cancel(self, req: Request) -> None:
        """The client went away: free the request wherever it is."""
        self.queues.pop(req.request_id, None)
        self.core.sched.abort(req)
        self.core.stats.forget(req)

    def reset_prefix_cache(self) -> bool:
        ok = self.core.pool.reset()
        if ok and self.core.on_events is not None:
            self.core.on_events(self.core.pool.take_events())
        return ok

    async def run(self) -> None:
        while True:
            await self._thawed.wait()
            step = self.core.begin(time.monotonic())
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(step.duration)
            for req in self.core.end(step, time.monotonic()):
                q = self.queues.get(req.request_id)
                if q is not None:
                    q.put_nowait(req.num_output)
                if req.finished:
                    self.queues.pop(req.request_id, None)
