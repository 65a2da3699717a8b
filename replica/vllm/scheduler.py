"""``PrefixAwareScheduler``: vLLM's V1 scheduler with two opt-in changes, loaded with
``--scheduler-cls replica.vllm.scheduler.PrefixAwareScheduler`` (``PrefixAwareAsyncScheduler``
where async scheduling is on, as on GPU).

It overrides narrow hooks only, never ``schedule()``:

- ``self.waiting`` becomes a :class:`CacheAwareQueue` (``cache_aware_admission``);
- ``_handle_blocked_waiting_request`` defers a request whose next uncached block is being
  computed by a running prefill (``dedupe_shared_prefixes``). vLLM caches a block when it
  schedules it, so a follower already hits every block scheduled so far; without a chunk cap
  (``--long-prefill-token-threshold``) no budget is ever left beside a pending prefill and the
  gate never fires. It is for replicas that set the cap (see ``replica.sim.policies``).

With every option off the class is vLLM's scheduler, step for step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from replica.vllm.options import PrefixAwareOptions, load_options
from replica.vllm.queue import CacheAwareQueue

log = logging.getLogger(__name__)


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
        if self.kvpick.dedupe_shared_prefixes and not self.scheduler_config.long_prefill_token_threshold:
            log.warning(
                "kvpick: dedupe_shared_prefixes has no effect without --long-prefill-token-threshold: "
                "vLLM already shares every prefix block it has scheduled"
            )

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

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        ready = super()._handle_blocked_waiting_request(request)
        if not ready or not self.kvpick.dedupe_shared_prefixes or request.num_computed_tokens:
            return ready
        if self.kvpick_clock() - request.arrival_time >= self.kvpick.aging_s:
            return True
        index = self.cached_prefix_tokens(request) // self.block_size
        if index >= len(request.block_hashes):
            return True
        return request.block_hashes[index] not in self._blocks_in_flight()

    def _blocks_in_flight(self) -> set[Any]:
        """Hashes of prompt blocks that running prefills have yet to compute."""
        pending: set[Any] = set()
        for running in self.running:
            if running.num_computed_tokens < running.num_prompt_tokens:
                start = running.num_computed_tokens // self.block_size
                pending.update(running.block_hashes[start:])
        return pending


class PrefixAwareAsyncScheduler(PrefixAwareScheduler, AsyncScheduler):
    """The same hooks on vLLM's ``AsyncScheduler`` (async scheduling, as on GPU)."""
