"""``PrefixAwareScheduler``: vLLM's V1 scheduler with an opt-in change, loaded with
``--scheduler-cls replica.vllm.scheduler.PrefixAwareScheduler`` (``PrefixAwareAsyncScheduler``
where async scheduling is on, as on GPU).

It overrides narrow hooks only, never ``schedule()``: ``self.waiting`` becomes a
:class:`CacheAwareQueue` (``cache_aware_admission``). With the option off the class is vLLM's
scheduler, step for step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from replica.vllm.options import PrefixAwareOptions, load_options
from replica.vllm.queue import CacheAwareQueue


class PrefixAwareScheduler(Scheduler):
    """See the module docstring. ``options`` and ``clock`` are for tests; the engine passes
    neither, and the options then come from the environment and ``--additional-config``."""

    def __init__(
        self,
        *args: Any,
        options: PrefixAwareOptions | None = None,
        clock: Callable[[], float] = time.time,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        self.kvpick = options or load_options(additional=extra if isinstance(extra, dict) else None)
        self.kvpick_clock = clock
        self._group_ids = list(range(len(self.kv_cache_config.kv_cache_groups)))
        if self.kvpick.cache_aware_admission and self.policy == SchedulingPolicy.FCFS:
            assert not self.waiting, "the waiting queue is replaced before any request arrives"
            self.waiting = CacheAwareQueue(self.cached_prefix_tokens, self.kvpick.aging_s, clock)

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt found in the prefix cache now (whole blocks). A pure
        lookup: it neither touches the LRU order nor counts as a cache query in the metrics."""
        pool = self.kv_cache_manager.block_pool
        hits = 0
        for block_hash in request.block_hashes:
            if pool.get_cached_block(block_hash, self._group_ids) is None:
                break
            hits += 1
        return hits * self.block_size


class PrefixAwareAsyncScheduler(PrefixAwareScheduler, AsyncScheduler):
    """The same hooks on vLLM's ``AsyncScheduler`` (async scheduling, as on GPU)."""
