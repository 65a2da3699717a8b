"""The simulated engine: scheduler steps timed by the cost model, driven in real time by asyncio.

Each step: schedule → step time from the roofline model (× ``time_scale``) → sleep → apply, then
wake the requests that produced a token. Requests wait on an asyncio.Queue of token counts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .blocks import BlockPool
from .costmodel import Profile
from .kv_events import Publisher, drain
from .scheduler import Request, Scheduler, SchedulerConfig


@dataclass
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0  # 0: derived from the profile
    time_scale: float = 1.0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


class Engine:
    def __init__(self, profile: Profile, cfg: EngineConfig, events: Publisher | None = None) -> None:
        self.profile, self.cfg = profile, cfg
        blocks = cfg.num_gpu_blocks or profile.num_gpu_blocks(cfg.block_size)
        self.pool = BlockPool(blocks, cfg.block_size)
        self.sched = Scheduler(self.pool, cfg.scheduler)
        self.queues: dict[int, asyncio.Queue[int]] = {}
        self._wake = asyncio.Event()
        self.finished = 0
        self.events = events

    def submit(self, req: Request) -> asyncio.Queue[int]:
        req.arrival = time.monotonic()
        q: asyncio.Queue[int] = asyncio.Queue()
        self.queues[req.request_id] = q
        self.sched.add(req)
        self._wake.set()
        return q

    def cancel(self, req: Request) -> None:
        """Client went away: drop the request wherever it is."""
        self.queues.pop(req.request_id, None)
        if req in self.sched.waiting:
            self.sched.waiting.remove(req)
        elif req in self.sched.running:
            self.sched.running.remove(req)
            self.pool.release(req.blocks)
            req.blocks = []

    async def run(self) -> None:
        while True:
            scheduled = self.sched.schedule(time.monotonic())
            if not scheduled:
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = [(n, r.num_computed) for r, n in scheduled if r.prefill_left > 0]
            decode = [r.num_computed for r, n in scheduled if r.prefill_left == 0]
            await asyncio.sleep(self.profile.step_time(prefill, decode) * self.cfg.time_scale)
            produced = self.sched.update(scheduled, time.monotonic())
            if self.events is not None:
                self.events.publish(drain(self.pool))
            for req in produced:
                q = self.queues.get(req.request_id)
                if q is not None:
                    q.put_nowait(req.num_output)
                if req.finished:
                    self.queues.pop(req.request_id, None)
                    self.finished += 1
