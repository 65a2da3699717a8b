"""Polls each endpoint's vLLM ``/metrics`` and updates its state and health.

Only the few families the picker reads are kept (a cheap line prefilter) before handing the text
to prometheus_client's parser, so scraping 64 endpoints every 200 ms stays light on the loop.

Health rules:
- a successful scrape → READY;
- no successful scrape for ``stale_after_s`` → DEGRADED (still routable);
- ``unreachable_after`` consecutive failures → UNREACHABLE (not routable) until one succeeds;
- ``/health`` (probed with every scrape) answering non-2xx, 404 aside → UNHEALTHY at once (not
  routable): vLLM's API server answers 5xx there when its engine is dead, while ``/metrics``
  still answers. Leaves the routable set within one ``interval_s`` + ``timeout_s``;
- busy (our requests in flight, or running + waiting > 0) with the engine's progress counters
  unchanged for ``stall_after_s`` → STALLED (not routable) until they move: a hung engine
  whose HTTP server still answers. Leaves within ``stall_after_s`` + one ``interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker.core.config import ScrapeConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import EndpointMetrics, EndpointState, Health

log = logging.getLogger(__name__)

WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
)
"""Families kept whole (every sample line whose name starts with one of these)."""
HISTOGRAMS = (
    "vllm:request_prefill_time_seconds",
    "vllm:request_prefill_kv_computed_tokens",
    "vllm:inter_token_latency_seconds",
    "vllm:iteration_tokens_total",
)
"""Histograms of which only ``_sum`` and ``_count`` are kept (the load model's inputs)."""
EXPECTED = (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError)
"""Failures of a scrape that are logged without a traceback (network, HTTP status, bad page)."""
_PREFIXES = (
    *WANTED,
    *(f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("sum", "count")),
    *(f"# TYPE {n}" for n in (*WANTED, *HISTOGRAMS)),
)


def prefilter(text: str) -> str:
    """The lines the picker reads; HELP lines and ``_bucket`` lines are dropped unparsed."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))


def _loras(value: str) -> frozenset[str]:
    return frozenset(x for x in value.split(",") if x)


SUMMED = {
    "vllm:prefix_cache_queries_total": "prefix_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_hits_total",
    "vllm:request_success_total": "request_success_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_count",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_computed_tokens_sum",
    "vllm:inter_token_latency_seconds_sum": "itl_seconds_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
}
"""vLLM counter and histogram samples summed over their label sets (engines, models, reasons)
into the :class:`EndpointMetrics` field named here."""


def parse_metrics(text: str, now: float = 0.0) -> EndpointMetrics:
    """vLLM ``/metrics`` text → :class:`EndpointMetrics`. Sums over engines (DP ranks).

    The one parser of vLLM metrics in the project: the scraper, ``make run``'s status line
    (``replica.sim.stack``) and the benchmarks' fleets all read replicas through it."""
    m = EndpointMetrics(updated_at=now)
    kv: list[float] = []
    lora_ts = -1.0
    for fam in text_string_to_metric_families(prefilter(text)):
        for s in fam.samples:
            name = s.name
            if name == "vllm:num_requests_running":
                m.running += s.value
            elif name == "vllm:num_requests_waiting":
                m.waiting += s.value
            elif name == "vllm:kv_cache_usage_perc":
                kv.append(s.value)
            elif name == "vllm:cache_config_info":
                bs, nb = s.labels.get("block_size", ""), s.labels.get("num_gpu_blocks", "")
                m.block_size = int(bs) if bs.isdigit() else m.block_size
                m.num_gpu_blocks = int(nb) if nb.isdigit() else m.num_gpu_blocks
            elif name == "vllm:lora_requests_info" and s.value >= lora_ts:
                lora_ts = s.value  # the gauge's value is a timestamp: keep the newest sample
                m.running_loras = _loras(s.labels.get("running_lora_adapters", ""))
                m.waiting_loras = _loras(s.labels.get("waiting_lora_adapters", ""))
                ml = s.labels.get("max_lora", "0")
                m.max_lora = int(ml) if ml.isdigit() else 0
            elif (summed := SUMMED.get(name)) is not None:
                setattr(m, summed, getattr(m, summed) + s.value)
            elif name in PROGRESS:
                m.progress_total = max(m.progress_total, 0.0) + s.value
    if kv:
        m.kv_usage = sum(kv) / len(kv)
    return m


PROGRESS = frozenset(
    {"vllm:iteration_tokens_total_count", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"}
)
"""Counters that move with engine steps: their sum is :attr:`EndpointMetrics.progress_total`."""


class Unhealthy(Exception):
    """The replica answered ``/health`` with an error status: its engine is dead."""


@dataclass(slots=True)
class Progress:
    """Judges one endpoint's engine stalled: busy, with its progress counters unchanged for
    ``after_s``. ``since`` is the last time they moved or the endpoint was idle."""

    after_s: float
    value: float = -1.0
    since: float = 0.0

    def stalled(self, state: EndpointState, now: float) -> bool:
        m = state.metrics
        # in flight, less the streams whose work the engine has finished (Envoy holds some open
        # for seconds without response bodies: an idle engine with one was judged stalled)
        ours = state.load.in_flight_requests - state.load.finished_streams
        busy = ours > 0 or m.running + m.waiting > 0
        if self.after_s <= 0 or m.progress_total < 0 or not busy or m.progress_total != self.value:
            self.value, self.since = m.progress_total, now
            return False
        return now - self.since > self.after_s


class Scraper:
    """One polling task per endpoint, started and stopped with the pool's membership."""

    def __init__(
        self,
        pool: Pool,
        cfg: ScrapeConfig,
        on_update: Callable[[EndpointState], None] = lambda s: None,
        on_error: Callable[[EndpointState, str], None] = lambda s, why: None,
    ) -> None:
        self.pool, self.cfg = pool, cfg
        self.on_update, self.on_error = on_update, on_error
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        pool.on_add(self._start)
        pool.on_remove(self._stop)

    async def __aenter__(self) -> Scraper:
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        for state in self.pool:
            self._start(state)
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()

    def _start(self, state: EndpointState) -> None:
        if self._session is None or state.key in self._tasks:
            return
        self._tasks[state.key] = asyncio.get_running_loop().create_task(self._poll(state))

    def _stop(self, state: EndpointState) -> None:
        task = self._tasks.pop(state.key, None)
        if task is not None:
            task.cancel()

    async def scrape_once(self, state: EndpointState, progress: Progress | None = None) -> None:
        """Read ``/metrics`` and probe ``/health`` together; raises :class:`Unhealthy` when the
        probe answers an error, any other exception when either fails."""
        assert self._session is not None, "Scraper used outside 'async with'"
        base = f"http://{state.key}"  # the key brackets an IPv6 address
        text, _ = await asyncio.gather(self._metrics_text(base), self._probe_health(base))
        now = time.monotonic()
        state.metrics = parse_metrics(text, now)
        stalled = progress is not None and progress.stalled(state, now)
        if stalled and state.health is not Health.STALLED:
            log.warning(
                "endpoint %s stalled: busy, engine counters still for %.1f s",
                state.key,
                self.cfg.stall_after_s,
            )
        state.health = Health.STALLED if stalled else Health.READY

    async def _metrics_text(self, base: str) -> str:
        assert self._session is not None
        async with self._session.get(base + "/metrics") as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            return await resp.text()

    async def _probe_health(self, base: str) -> None:
        if not self.cfg.health_path:
            return
        assert self._session is not None
        async with self._session.get(base + self.cfg.health_path) as resp:
            if resp.status >= 300 and resp.status != 404:
                raise Unhealthy(f"{self.cfg.health_path} answered HTTP {resp.status}")

    async def _poll(self, state: EndpointState) -> None:
        """Scrape until cancelled. Any ``Exception`` counts as a failed scrape: an unexpected one is
        logged with its traceback (once per streak of the same kind) and polling goes on, so no
        endpoint's health freezes. ``CancelledError`` is not an ``Exception`` and ends the task."""
        failures = 0
        last_unexpected = ""
        progress = Progress(self.cfg.stall_after_s)
        while True:
            try:
                await self.scrape_once(state, progress)
                failures = 0
                last_unexpected = ""
                self.on_update(state)
            except Unhealthy as exc:
                if state.health is not Health.UNHEALTHY:
                    log.warning("endpoint %s unhealthy: %s", state.key, exc)
                state.health = Health.UNHEALTHY
                self.on_error(state, "unhealthy")
            except Exception as exc:
                failures += 1
                reason = type(exc).__name__
                if not isinstance(exc, EXPECTED) and reason != last_unexpected:
                    log.exception("endpoint %s: unexpected error while scraping", state.key)
                    last_unexpected = reason
                self.on_error(state, reason)
                if failures >= self.cfg.unreachable_after:
                    if state.health is not Health.UNREACHABLE:
                        log.warning("endpoint %s unreachable: %s", state.key, exc)
                    state.health = Health.UNREACHABLE
                elif (
                    state.health is Health.READY
                    and time.monotonic() - state.metrics.updated_at > self.cfg.stale_after_s
                ):
                    state.health = Health.DEGRADED
            await asyncio.sleep(self.cfg.interval_s)
