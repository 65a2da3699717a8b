"""The benchmark's scheduler: ours, writing its schedule step by step to a JSON-lines file, with
its options switched between runs from a file, so that every configuration runs on the same
engine process, interleaved run by run (``python -m bench.vllm_pressure``). For benchmarks
only: nothing in the chart or the launcher loads it.

Loaded with ``--scheduler-cls bench.vllm_trace.BenchScheduler``. Environment:

- ``KVPICK_SCHEDULE_TRACE`` (required): the trace. One line per step that scheduled anything::

      {"t": 1700000000.123, "waiting": 3,
       "new": {"KEY": arrival_time, ...},
       "run": [[KEY, computed_before, scheduled, cached_at_admission], ...]}

  ``KEY`` is ``bench.vllm_pressure.prompt_key`` of the prompt, so the client names its
  requests without sending an id; ``t`` and ``arrival_time`` are on the engine's clock
  (``time.time``). Each line is flushed as it is written (the engine is stopped with SIGTERM).
- ``KVPICK_BENCH_OPTIONS`` (required): a JSON file of :class:`PrefixAwareOptions` fields plus
  ``long_prefill_token_threshold``. It is re-read at the first step after it changes, which
  must find the engine with nothing running (the client changes it between runs only).

With every option off the scheduler is vLLM's own, step for step
(``tests/vllm/test_prefix_aware_scheduler.py::test_all_options_off_equals_vllm``)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import IO, Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request

from bench.vllm_pressure import prompt_key
from replica.vllm.queue import CacheAwareQueue
from replica.vllm.scheduler import PrefixAwareScheduler


class _Trace:
    """The open trace file, and each live request's key and cached tokens at admission. One
    writer: the engine's scheduler."""

    def __init__(self, path: str) -> None:
        self.out: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine
        self.keys: dict[str, str] = {}
        self.cached: dict[str, int] = {}

    def step(self, output: SchedulerOutput, requests: dict[str, Request], waiting: int) -> None:
        for req_id in output.finished_req_ids:
            self.keys.pop(req_id, None)
            self.cached.pop(req_id, None)
        if not output.num_scheduled_tokens:
            return
        new = {}
        for data in output.scheduled_new_reqs:
            request = requests[data.req_id]
            key = self.keys[data.req_id] = prompt_key(request.prompt_token_ids or ())
            new[key] = request.arrival_time
            self.cached[data.req_id] = data.num_computed_tokens
        run = []
        for req_id, scheduled in output.num_scheduled_tokens.items():
            request = requests[req_id]
            key = self.keys.get(req_id) or prompt_key(request.prompt_token_ids or ())
            before = request.num_computed_tokens - scheduled  # already advanced by schedule()
            run.append([key, before, scheduled, self.cached.get(req_id, 0)])
        line = {"t": time.time(), "waiting": waiting, "new": new, "run": run}
        self.out.write(json.dumps(line, separators=(",", ":")) + "\n")


class BenchScheduler(PrefixAwareScheduler):
    """Our scheduler, traced, options switched between runs (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        trace = os.environ.get("KVPICK_SCHEDULE_TRACE")
        self.kvpick_options_file = os.environ.get("KVPICK_BENCH_OPTIONS", "")
        assert trace and self.kvpick_options_file, (
            "BenchScheduler needs KVPICK_SCHEDULE_TRACE and KVPICK_BENCH_OPTIONS"
        )
        self.kvpick_trace = _Trace(trace)
        self.kvpick_options_seen = -1

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._switch_options()
        output = super().schedule(throttle_prefills)
        self.kvpick_trace.step(output, self.requests, len(self.waiting))
        return output

    def _switch_options(self) -> None:
        mtime = os.stat(self.kvpick_options_file).st_mtime_ns
        if mtime == self.kvpick_options_seen:
            return
        assert not self.running, "the benchmark's options changed while requests were running"
        with open(self.kvpick_options_file) as f:
            raw = json.load(f)
        self.scheduler_config.long_prefill_token_threshold = int(raw.pop("long_prefill_token_threshold", 0))
        self.kvpick = dataclasses.replace(self.kvpick, **raw)
        waiting = list(self.waiting)
        if self.kvpick.cache_aware_admission:
            queue: FCFSRequestQueue = CacheAwareQueue(
                self.cached_prefix_tokens, self.kvpick.aging_s, self.kvpick_clock
            )
        else:
            queue = FCFSRequestQueue()
        queue.extend(waiting)
        self.waiting = queue
        self.kvpick_options_seen = mtime
