"""Polls each endpoint's vLLM ``/metrics`` and updates its state and health.

Only the sample lines of the few families the picker reads are parsed (:func:`samples`: a prefix
test per line, then one regular expression per kept line); HELP, TYPE and ``_bucket`` lines are
never parsed. prometheus_client's parser cost about 1.2 ms per scrape of a simulated replica's
page even on the prefiltered lines, most of a scrape's CPU (``python -m bench.scrape``).

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

Shared scrapes (several picker replicas, :class:`ScrapeShare`): each endpoint is scraped by one
picker, which shares every outcome (metrics, or the failure) with the others; they apply it
through the same rules, so a failure counts on every picker as on the one that scraped, and
each judges a stall with its own in-flight work. The bounds above then hold on every picker
plus the time the outcome takes to reach it (the share's batching, 20 ms, and the network);
when the owner itself dies, plus the time its peers take to drop it (the share's TTL, 1 s), after
which the next owner scrapes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

import aiohttp

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
    "vllm:request_decode_time_seconds",
)
"""Histograms of which only ``_sum`` and ``_count`` are kept (the load model's inputs)."""
EXPECTED = (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError)
"""Failures of a scrape that are logged without a traceback (network, HTTP status, bad page)."""
_PREFIXES = (*WANTED, *(f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("sum", "count")))

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*")
"""A sample line of the text exposition format: name, labels (between the braces), value and an
optional timestamp (ignored)."""
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(?:,|$)')
"""One ``name="value"`` pair of a label set, with its separating comma (a trailing one allowed)."""
_ESCAPE = re.compile(r"\\(.)")


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of each sample line of ``text`` (Prometheus text format 0.0.4)
    whose name starts with one the picker reads (:data:`WANTED`, and ``_sum``/``_count`` of
    :data:`HISTOGRAMS`); the other lines are passed over unparsed. Label values are unescaped
    (``\\\\``, ``\\"``, ``\\n``). Raises ``ValueError`` on a kept line that is not a sample.
    ``tests/unit/test_scrape.py`` holds it equal to prometheus_client's parser (hypothesis)."""
    for line in text.split("\n"):  # not splitlines(): a label value may hold \x1e, \x85, \u2028 ...
        if not line.startswith(_PREFIXES):
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ValueError(f"not a sample line: {line[:120]!r}")
        name, body, value = m.groups()
        labels: dict[str, str] = {}
        if body:
            pos, end = 0, len(body)
            while pos < end:
                lm = _LABEL.match(body, pos)
                if lm is None or lm.end() == pos:
                    raise ValueError(f"bad label set: {line[:120]!r}")
                v = lm.group(2)
                labels[lm.group(1)] = _ESCAPE.sub(_unescape, v) if "\\" in v else v
                pos = lm.end()
        yield name, labels, float(value)


def _unescape(m: re.Match[str]) -> str:
    c = m.group(1)
    return "\n" if c == "n" else c


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
    "vllm:request_decode_time_seconds_sum": "decode_seconds_sum",
    "vllm:request_decode_time_seconds_count": "decode_count",
}
"""vLLM counter and histogram samples summed over their label sets (engines, models, reasons)
into the :class:`EndpointMetrics` field named here."""


def parse_metrics(text: str, now: float = 0.0) -> EndpointMetrics:
    """vLLM ``/metrics`` text → :class:`EndpointMetrics`. Sums over engines (DP ranks).

    The one parser of vLLM metrics in the project: the scraper, ``make run``'s status line
    (``kvlaunch.run``) and the benchmarks' fleets all read replicas through it."""
    m = EndpointMetrics(updated_at=now)
    kv: list[float] = []
    models: set[str] = set()
    lora_ts = -1.0
    for name, labels, value in samples(text):
        if name == "vllm:num_requests_running":
            m.running += value
            served = labels.get("model_name", "")
            if served and len(served) <= MAX_NAME and len(models) < MAX_LORAS:
                models.add(served)
        elif name == "vllm:num_requests_waiting":
            m.waiting += value
        elif name == "vllm:kv_cache_usage_perc":
            kv.append(value)
        elif name == "vllm:cache_config_info":
            bs, nb = labels.get("block_size", ""), labels.get("num_gpu_blocks", "")
            m.block_size = int(bs) if bs.isdigit() else m.block_size
            m.num_gpu_blocks = int(nb) if nb.isdigit() else m.num_gpu_blocks
        elif name == "vllm:lora_requests_info" and value >= lora_ts:
            lora_ts = value  # the gauge's value is a timestamp: keep the newest sample
            m.running_loras = _loras(labels.get("running_lora_adapters", ""))
            m.waiting_loras = _loras(labels.get("waiting_lora_adapters", ""))
            ml = labels.get("max_lora", "0")
            m.max_lora = int(ml) if ml.isdigit() else 0
        elif (summed := SUMMED.get(name)) is not None:
            setattr(m, summed, getattr(m, summed) + value)
        elif name in PROGRESS:
            m.progress_total = max(m.progress_total, 0.0) + value
    if kv:
        m.kv_usage = sum(kv) / len(kv)
    if models:
        m.served_models = frozenset(models)
    return m


PROGRESS = frozenset(
    {"vllm:iteration_tokens_total_count", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"}
)
"""Counters that move with engine steps: their sum is :attr:`EndpointMetrics.progress_total`."""


WIRE_FIELDS = tuple(f.name for f in fields(EndpointMetrics) if f.name != "updated_at")
"""The :class:`EndpointMetrics` fields a shared scrape carries, in this order (``updated_at`` is
the receiver's: its clock, less the scrape's age)."""
OPTIONAL_WIRE_FIELDS = 3
"""The last fields of :data:`WIRE_FIELDS` an older peer does not send (``served_models``,
``decode_seconds_sum``, ``decode_count``): a list without them is read with their defaults."""
MAX_LORAS = 256
MAX_NAME = 256


def metrics_to_wire(m: EndpointMetrics) -> list[Any]:
    """``m`` as a msgpack-able list of :data:`WIRE_FIELDS` (frozensets as sorted lists)."""
    return [sorted(v) if isinstance(v, frozenset) else v for v in (getattr(m, n) for n in WIRE_FIELDS)]


def metrics_from_wire(raw: Any) -> EndpointMetrics:
    """The inverse of :func:`metrics_to_wire`, checked: raises ``ValueError`` for anything else. A
    longer list (a newer peer's extra fields) is read up to :data:`WIRE_FIELDS`; a shorter one by
    at most :data:`OPTIONAL_WIRE_FIELDS` (an older peer's) keeps those fields' defaults."""
    if not (isinstance(raw, list) and len(raw) >= len(WIRE_FIELDS) - OPTIONAL_WIRE_FIELDS):
        raise ValueError("shared metrics are not a list of the expected fields")
    m = EndpointMetrics()
    for name, v in zip(WIRE_FIELDS, raw, strict=False):
        default = getattr(m, name)
        if isinstance(default, frozenset):
            if not (isinstance(v, list) and len(v) <= MAX_LORAS):
                raise ValueError(f"{name}: not a list of at most {MAX_LORAS} names")
            if not all(isinstance(x, str) and len(x) <= MAX_NAME for x in v):
                raise ValueError(f"{name}: a name that is not a short string")
            v = frozenset(v)
        elif name in ("block_size", "num_gpu_blocks"):
            if not (v is None or (type(v) is int and v > 0)):
                raise ValueError(f"{name}: not a positive int or None")
        elif name == "max_lora":
            if not (type(v) is int and 0 <= v < 1 << 31):
                raise ValueError(f"{name}: not a non-negative int")
        elif not (
            type(v) in (int, float) and math.isfinite(v) and v >= (-1 if name == "progress_total" else 0)
        ):
            raise ValueError(f"{name}: not a finite non-negative number")
        else:
            v = float(v)
        setattr(m, name, v)
    return m


class Unhealthy(Exception):
    """The replica answered ``/health`` with an error status: its engine is dead."""


UNHEALTHY = "unhealthy"
"""The :attr:`Outcome.reason` of a scrape whose ``/health`` probe answered an error."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One scrape's result, applied by the picker that scraped and by every peer it shares it
    with (:class:`ScrapeShare`): ``metrics`` on success, else ``reason`` (:data:`UNHEALTHY`, or
    the failure's exception type name)."""

    metrics: EndpointMetrics | None
    reason: str = ""


class ScrapeShare(Protocol):
    """Splits the scraping among picker replicas: each endpoint is scraped by one of them (its
    owner), which shares every :class:`Outcome`; the others apply it as if they had scraped.
    :class:`picker.feeds.peers.Peers` implements it over the peer channel."""

    def owns(self, key: str) -> bool:
        """Whether this picker scrapes ``key`` (True for every key when it is alone)."""
        ...

    def share(self, key: str, outcome: Outcome, scraped_at: float) -> None:
        """Tell the peers about one of our scrapes (``scraped_at``: our ``time.monotonic()``)."""
        ...


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


@dataclass(slots=True)
class Track:
    """What the health rules remember of one endpoint between its scrapes (ours or a peer's)."""

    progress: Progress
    failures: int = 0
    """Consecutive failed scrapes, ours and the owner's alike (so it carries over when the
    ownership moves)."""
    heard_at: float = 0.0
    """When a peer's outcome for it last arrived (the task's start until then)."""
    owned: bool = True
    """Whether it was ours to scrape at its last tick."""
    scraping: bool = True
    """Whether its last tick scraped it (ours, or its owner silent for too long)."""


class Scraper:
    """One polling task per endpoint, started and stopped with the pool's membership.

    Alone (``share`` None), every task scrapes its endpoint every ``interval_s``. With a
    :class:`ScrapeShare`, a task scrapes only while ``share.owns`` its endpoint, and shares each
    outcome; the peers' outcomes arrive through :meth:`apply_remote`. A task whose endpoint has
    had no peer outcome for ``stale_after_s`` scrapes it itself (an owner that stopped scraping
    it, or that does not know the endpoint yet), and :meth:`rebalance` restarts, so that it scrapes
    at once, every task whose endpoint has just become ours (its owner went silent).

    The one writer of every endpoint's ``metrics`` and ``health`` (its own scrapes and its peers'
    alike go through :meth:`_record`), and of the :class:`Track` of each.
    Scrapes are aligned on multiples of ``interval_s`` of the loop's clock, shifted by a phase
    drawn once per scraper: one picker's outcomes for all the endpoints it owns come together
    and are shared in one message, and pickers on one host (whose monotonic clocks are the same)
    do not all scrape, and wake their peers, at the same instant."""

    def __init__(
        self,
        pool: Pool,
        cfg: ScrapeConfig,
        on_update: Callable[[EndpointState], None] = lambda s: None,
        on_error: Callable[[EndpointState, str], None] = lambda s, why: None,
        share: ScrapeShare | None = None,
    ) -> None:
        self.pool, self.cfg, self.share = pool, cfg, share
        self.on_update, self.on_error = on_update, on_error
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._tracks: dict[str, Track] = {}
        self._session: aiohttp.ClientSession | None = None
        self._phase = random.random() * cfg.interval_s
        """Offset of this scraper's ticks on the loop's clock (class doc)."""
        self.own_scrapes = 0
        """Scrapes done here (a counter for tests and telemetry)."""
        self.peer_outcomes = 0
        """Outcomes of peers' scrapes applied here."""
        pool.on_add(self._start)
        pool.on_remove(self._stop)

    def share_with(self, share: ScrapeShare) -> None:
        """Share the scraping through ``share`` from now on (the peer channel registers itself
        here when it is made: it feeds this scraper the peers' outcomes and this scraper tells
        it ours, so one side of that cycle is a registration). Before :meth:`__aenter__`."""
        assert self.share is None, "the scrapes are already shared"
        assert not self._tasks, "share_with after the scraping started"
        self.share = share

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
        self._tasks[state.key] = asyncio.get_running_loop().create_task(
            self._poll(state, self._track(state.key))
        )

    def _track(self, key: str) -> Track:
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = Track(Progress(self.cfg.stall_after_s), heard_at=time.monotonic())
        return track

    def _stop(self, state: EndpointState) -> None:
        self._tracks.pop(state.key, None)
        task = self._tasks.pop(state.key, None)
        if task is not None:
            task.cancel()

    def rebalance(self) -> None:
        """The set of pickers sharing the scrapes changed: every endpoint that has just become
        ours is scraped at once (its task restarted), not at its next tick."""
        if self.share is None:
            return
        for key, track in self._tracks.items():
            state = self.pool.get(key)
            if state is None or track.owned or not self.share.owns(key):
                continue
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
            track.owned = True
            self._start(state)

    def scrapes_here(self, key: str) -> bool:
        """Whether ``key``'s last tick scraped it here (ours, or taken over from a silent owner)."""
        track = self._tracks.get(key)
        return track is not None and track.scraping

    def apply_remote(self, key: str, outcome: Outcome, scraped_at: float) -> bool:
        """A peer's scrape of ``key`` (``scraped_at`` on our clock). False if ``key`` is not in
        our pool, or the outcome is older than the metrics we hold."""
        state = self.pool.get(key)
        if state is None:
            return False
        track = self._track(key)
        track.heard_at = time.monotonic()
        if outcome.metrics is not None and scraped_at <= state.metrics.updated_at:
            return False  # two pickers scraped it (a takeover): keep the newer
        self.peer_outcomes += 1
        self._record(state, track, outcome, scraped_at)
        return True

    async def scrape_once(self, state: EndpointState) -> EndpointMetrics:
        """Read ``/metrics`` and probe ``/health`` together; raises :class:`Unhealthy` when the
        probe answers an error, any other exception when either fails."""
        assert self._session is not None, "Scraper used outside 'async with'"
        base = f"http://{state.key}"  # the key brackets an IPv6 address
        text, _ = await asyncio.gather(self._metrics_text(base), self._probe_health(base))
        return parse_metrics(text)

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

    def _record(self, state: EndpointState, track: Track, outcome: Outcome, at: float) -> None:
        """Apply one scrape's outcome (ours or a peer's) to the endpoint's metrics and health."""
        if outcome.metrics is not None:
            outcome.metrics.updated_at = at
            state.metrics = outcome.metrics
            track.failures = 0
            stalled = track.progress.stalled(state, at)
            if stalled and state.health is not Health.STALLED:
                log.warning(
                    "endpoint %s stalled: busy, engine counters still for %.1f s",
                    state.key,
                    self.cfg.stall_after_s,
                )
            state.health = Health.STALLED if stalled else Health.READY
            self.on_update(state)
        elif outcome.reason == UNHEALTHY:
            if state.health is not Health.UNHEALTHY:
                log.warning("endpoint %s unhealthy: its %s answers an error", state.key, self.cfg.health_path)
            state.health = Health.UNHEALTHY
            self.on_error(state, UNHEALTHY)
        else:
            track.failures += 1
            self.on_error(state, outcome.reason)
            if track.failures >= self.cfg.unreachable_after:
                if state.health is not Health.UNREACHABLE:
                    log.warning("endpoint %s unreachable: %s", state.key, outcome.reason)
                state.health = Health.UNREACHABLE
            else:
                self._age(state)

    def _age(self, state: EndpointState) -> None:
        if (
            state.health is Health.READY
            and time.monotonic() - state.metrics.updated_at > self.cfg.stale_after_s
        ):
            state.health = Health.DEGRADED

    async def _scrape(self, state: EndpointState, last_unexpected: str) -> Outcome:
        """One scrape as an :class:`Outcome`: any ``Exception`` is a failed scrape, an unexpected
        one logged with its traceback unless it is of ``last_unexpected``'s kind (once per streak).
        ``CancelledError`` is not an ``Exception`` and ends the task."""
        try:
            return Outcome(await self.scrape_once(state))
        except Unhealthy:
            return Outcome(None, UNHEALTHY)
        except Exception as exc:
            reason = type(exc).__name__
            if not isinstance(exc, EXPECTED) and reason != last_unexpected:
                log.exception("endpoint %s: unexpected error while scraping", state.key)
            return Outcome(None, reason)

    def _ours(self, key: str, track: Track) -> bool:
        """Whether to scrape ``key`` at this tick: ours, or no peer has shared it for too long."""
        if self.share is None:
            return True
        track.owned = self.share.owns(key)
        track.scraping = track.owned or time.monotonic() - track.heard_at > self.cfg.stale_after_s
        return track.scraping

    async def _poll(self, state: EndpointState, track: Track) -> None:
        """Scrape (or wait for the owner's outcomes) until cancelled; polling never stops on an
        error, so no endpoint's health freezes."""
        loop = asyncio.get_running_loop()
        last_unexpected = ""
        interval = self.cfg.interval_s
        while True:
            if self._ours(state.key, track):
                outcome = await self._scrape(state, last_unexpected)
                last_unexpected = "" if outcome.metrics is not None else outcome.reason
                at = time.monotonic()
                self.own_scrapes += 1
                self._record(state, track, outcome, at)
                if self.share is not None:
                    self.share.share(state.key, outcome, at)
            else:
                self._age(state)
            await asyncio.sleep(interval - (loop.time() - self._phase) % interval)
