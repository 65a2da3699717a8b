"""The load model: each endpoint's speed, calibrated online from its own vLLM ``/metrics``.

Per endpoint the model says (:class:`~picker.core.endpoints.types.EndpointModel`):

- ``prefill_rate``: uncached prompt tokens per second;
- ``step_s(b) = step_base_s + step_per_seq_s * b``: one engine step with ``b`` running requests
  (what a decode token costs, and what a prefill waits for when it joins a busy batch);
- ``uncached_per_request``: the uncached prompt tokens of a typical request, to turn the waiting
  queue gauge into seconds: ``waiting * uncached_per_request / prefill_rate``.

**Inputs** (vLLM 0.32 names; :mod:`picker.feeds.scrape` parses them): between two scrapes of one
endpoint, with ``d`` the change of a cumulative counter,

- prefill: ``d vllm:request_prefill_kv_computed_tokens_sum`` uncached tokens took
  ``d vllm:request_prefill_time_seconds_sum`` seconds over ``d …_count`` requests (vLLM observes
  both histograms for the same requests, when they finish; prefill time is first token − first
  scheduled, so queueing is not in it). One step per request is fixed cost, not per-token work,
  so ``1 / prefill_rate = (d prefill_sum - d count * step_s(b_pf)) / d uncached``, with ``b_pf``
  the running gauge when those prefills ran: the scrape nearest ``d vllm:request_decode_time_seconds_sum
  / d …_count`` plus their mean prefill time before now (the histograms move at the finish,
  seconds later, when the batch may be far larger; without the decode histogram, ``b``);
- decode: ``y = d vllm:inter_token_latency_seconds_sum / d …_count`` is a decode token's mean
  wait, at the mean of the ``vllm:num_requests_running`` gauge at both scrapes (``b``). It is the
  step plus the prefill work batched with those decodes: ``y = base + per_seq * b + z * p`` with
  ``p = b * prefilled / d itl_count`` (``prefilled``: the uncached tokens whose prefill ended in
  the interval, ``d vllm:prompt_tokens_total - d vllm:prefix_cache_hits_total``, both counted when
  it happens) and ``z`` the seconds one prefill token adds to a step that also decodes. A
  least-squares fit of all three, weighted by tokens, gives ``step_base_s`` and
  ``step_per_seq_s``; ``z`` is fit, not taken as ``1 / prefill_rate``, because on a GPU the two
  differ (a decode step is memory-bound and hides under a prefill's compute: on the simulated
  H100 8B, ``1 / z`` is about 50k tokens/s against a 30k prefill rate), and because taking it
  from the prefill fit made the two fits feed each other (below). Without spread in ``p`` (no
  prefill beside the decodes, or always the same), ``z = 1 / prefill_rate``.

Why not the finished requests' uncached tokens for ``p``, and why not ``z = 1 / prefill_rate``
(the fit before 2026-11-28): both histograms are observed when a request *finishes*, seconds
after its prefill, so in the first seconds of load the decodes' waits had nothing taken out, the
step line came out 2× the engine's, the prefill fit took that too-long step out of each prefill
and read the rate 1.45× too fast, and that fast rate took too little out of the next decode
samples: a fixed point 40–46k tokens/s on a 16 ms step against the engine's 30k on 8 ms
(bench/results/2026-11-27-scaling.md, "Calibration bias").

Nothing here reads a response: the estimates need no body parsing and no per-request timing, so
an error or a non-streamed response cannot move them.

**Pooling.** Every sum is kept per endpoint and for the whole pool (the sum over endpoints).
The pool's fit has the most data and the widest spread of batch sizes; an endpoint's own data
only sets a speed *factor* against the pool, ``f = own / pool`` (prefill rate, and step time at
the batch sizes it saw), shrunk toward 1 in log space::

    f_used = f ** (n / (n + prior_scrapes))

where ``n`` is the number of the endpoint's scrape deltas with that kind of work in them
(faded while the endpoint sits idle, so that one measured slow is tried again: ``idle_fade``). With
``n`` well below ``prior_scrapes`` (32 by default) an endpoint is "too few": its deltas cover a
few requests each, and a request's prefill time depends on what happened to be batched with it
(a decode-heavy batch, another prefill's chunk, a cached context to attend to), so one delta is
off by tens of percent, and on a shared CPU by more. At ``n = 32`` the factor counts half, at
128 four fifths; a factor within ``factor_dead_band`` (30%) of 1 counts as 1. This is what lets a
mixed pool (an H100 beside an A100, a replica with a noisy neighbour) get per-endpoint speeds
without the noise of per-endpoint estimates on identical replicas, which chase endpoints away from
their caches (figures: bench/results/hardware.md). Sums decay by ``1 - 1 / window`` per delta, so
the model follows a replica that slows down.

Until the pool has seen any work the model is :class:`CalibrationConfig`'s defaults (an H100
running an 8B model) and says so (``source``).

Writer: :class:`Calibrator` alone writes ``EndpointState.model``; it is called with each
successful scrape (the scraper's update hook, or cluster mode's simulated scrape).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field

from picker.core.endpoints.types import EndpointMetrics, EndpointModel, EndpointState


@dataclass(frozen=True)
class CalibrationConfig:
    default_prefill_rate: float = 10_000.0
    """Uncached prompt tokens/s before any prefill has been measured."""
    default_step_base_s: float = 0.005
    """Fixed cost of one engine step, in seconds, before any decode has been measured."""
    default_step_per_seq_s: float = 0.0005
    """Added step time per running request, in seconds, before any decode has been measured."""
    default_uncached_per_request: float = 512.0
    """Uncached prompt tokens of a typical request, before any has been measured."""
    prior_scrapes: float = 32.0
    """Scrape deltas of an endpoint's own at which its speed factor counts half (see above)."""
    window: float = 64.0
    """Decay of the sums: each delta multiplies the older ones by ``1 - 1/window``."""
    min_prefill_tokens: float = 16.0
    """A delta with fewer uncached tokens carries no prefill-rate information (a full hit)."""
    min_batch_spread: float = 2.0
    """Standard deviation of the running count (requests) needed to fit the step line's slope."""
    min_prefill_spread: float = 0.25
    """Standard deviation of the decodes' prefill load ``p``, relative to its mean, needed to fit
    what a prefill token adds to a decode step (else it is ``1 / prefill_rate``)."""
    batch_shape: float = 0.05
    """Without that spread: the step's growth per running request, relative to its base (a
    decode step is mostly fixed cost)."""
    factor_dead_band: float = 0.3
    """A shrunk factor within this fraction of 1 is 1: identical replicas measure a few percent
    apart, and ranking on that difference would send every cold request to whichever looks
    fastest (all cold prompts onto one replica's cache) instead of breaking the tie at random."""
    max_factor: float = 20.0
    """Clamp on an endpoint's speed factor against the pool (and its inverse)."""
    max_step: float = 4.0
    """One delta may say the endpoint is at most this many times slower than its current model
    (prefill seconds per uncached token, step time at its batch size): a stalled engine's one
    delta (10 s of prefill for a few hundred tokens, seen on vLLM-CPU) would otherwise drag the
    pooled rate down 5×, and every other endpoint's factor up against it. A real slowdown
    still shows, over a few deltas: the model moves up to this factor per delta."""
    idle_fade: float = 16.0
    """Once an endpoint has sat idle (no work of its own in a delta, nothing running or waiting,
    nothing of ours in flight) for ``idle_fade`` scrapes in a row, the count of its own deltas
    is multiplied by ``1 - 1/idle_fade`` per further idle scrape: it halves in about 11 (2 s at
    200 ms). Short idle gaps between requests do not fade it. Without this a replica
    measured slow once (a burst of contention, a stall) gets no traffic, so no new evidence,
    and keeps its factor for ever. As the count fades its factor shrinks back to 1, and it is
    tried again."""

    def __post_init__(self) -> None:
        if (
            min(
                self.default_prefill_rate,
                self.prior_scrapes,
                self.window - 1,
                self.max_factor - 1,
                self.idle_fade - 1,
                self.max_step - 1,
            )
            <= 0
        ):
            raise ValueError(
                f"calibration: rates, prior_scrapes must be > 0, window, max_factor, idle_fade and max_step > 1: {self}"
            )
        if self.default_step_base_s < 0 or self.default_step_per_seq_s < 0:
            raise ValueError(f"calibration: step times must be >= 0: {self}")
        if self.min_batch_spread <= 0 or self.min_prefill_spread <= 0:
            # a zero spread admits a fit over data with none: a division by zero in _step_line
            raise ValueError(f"calibration: min_batch_spread and min_prefill_spread must be > 0: {self}")

    def default_model(self) -> EndpointModel:
        return EndpointModel(
            self.default_prefill_rate,
            self.default_step_base_s,
            self.default_step_per_seq_s,
            self.default_uncached_per_request,
        )


@dataclass(slots=True)
class Sums:
    """Decayed sums of one endpoint's scrape deltas (or of the whole pool's)."""

    pf_seconds: float = 0.0
    """Prefill seconds net of one step per request."""
    pf_tokens: float = 0.0
    """Uncached prompt tokens."""
    pf_requests: float = 0.0
    pf_n: float = 0.0
    """Deltas with prefill work in them (for the shrinkage): a count, faded only while the
    endpoint is idle (``CalibrationConfig.idle_fade``)."""
    d_w: float = 0.0
    d_wb: float = 0.0
    d_wbb: float = 0.0
    d_wy: float = 0.0
    d_wby: float = 0.0
    d_wp: float = 0.0
    """Decode sums: weight ``w`` (tokens), running ``b``, wait ``y`` [s], prefill load ``p``."""
    d_wbp: float = 0.0
    d_wpp: float = 0.0
    d_wpy: float = 0.0
    d_n: float = 0.0

    def decay(self, keep: float) -> None:
        self.pf_seconds *= keep
        self.pf_tokens *= keep
        self.pf_requests *= keep
        self.d_w *= keep
        self.d_wb *= keep
        self.d_wbb *= keep
        self.d_wy *= keep
        self.d_wby *= keep
        self.d_wp *= keep
        self.d_wbp *= keep
        self.d_wpp *= keep
        self.d_wpy *= keep

    def add(self, other: Sums, sign: float) -> None:
        self.pf_seconds += sign * other.pf_seconds
        self.pf_tokens += sign * other.pf_tokens
        self.pf_requests += sign * other.pf_requests
        self.d_w += sign * other.d_w
        self.d_wb += sign * other.d_wb
        self.d_wbb += sign * other.d_wbb
        self.d_wy += sign * other.d_wy
        self.d_wby += sign * other.d_wby
        self.d_wp += sign * other.d_wp
        self.d_wbp += sign * other.d_wbp
        self.d_wpp += sign * other.d_wpp
        self.d_wpy += sign * other.d_wpy
        self.pf_n += sign * other.pf_n
        self.d_n += sign * other.d_n

    def copy(self) -> Sums:
        s = Sums()
        s.add(self, 1.0)
        return s


@dataclass(frozen=True, slots=True)
class Delta:
    """What happened on one endpoint between two scrapes."""

    uncached_tokens: float
    prefill_seconds: float
    prefill_requests: float
    itl_seconds: float
    itl_tokens: float
    mean_running: float
    prefilled_tokens: float = 0.0
    """Uncached tokens whose prefill ended in the interval (not at the request's finish)."""
    ago_s: float = -1.0
    """How long before the later scrape the finished requests' prefills ran (their mean decode
    plus prefill time); -1 when the replica exports no decode histogram."""


def delta(prev: EndpointMetrics, cur: EndpointMetrics) -> Delta | None:
    """The change between two scrapes; None when a counter went backwards (the replica restarted)
    or no time passed."""
    d_uncached = cur.prefill_computed_tokens_sum - prev.prefill_computed_tokens_sum
    d_pf = cur.prefill_seconds_sum - prev.prefill_seconds_sum
    d_pfn = cur.prefill_count - prev.prefill_count
    d_itl = cur.itl_seconds_sum - prev.itl_seconds_sum
    d_itln = cur.itl_count - prev.itl_count
    if min(d_uncached, d_pf, d_pfn, d_itl, d_itln) < 0 or cur.updated_at <= prev.updated_at:
        return None
    prefilled = (cur.prompt_tokens_total - prev.prompt_tokens_total) - (
        cur.prefix_hits_total - prev.prefix_hits_total
    )
    d_dec, d_decn = cur.decode_seconds_sum - prev.decode_seconds_sum, cur.decode_count - prev.decode_count
    ago = (d_dec / d_decn + d_pf / d_pfn) if d_decn > 0 and d_pfn > 0 and d_dec >= 0 else -1.0
    b = (prev.running + cur.running) / 2
    return Delta(d_uncached, d_pf, d_pfn, d_itl, d_itln, b, max(0.0, prefilled), ago)


HISTORY = 1024
"""Scrapes of running-gauge history kept per endpoint (about 200 s at 200 ms): how far back a
finished request's prefill is looked up."""


class GaugeHistory:
    """One endpoint's running gauge at its last :data:`HISTORY` to ``2 * HISTORY`` scrapes, as two
    ``array('d')`` (16 bytes a scrape: at most 32 KiB an endpoint), times ascending. Writer: the
    :class:`Calibrator` that owns it, at each scrape of the endpoint."""

    __slots__ = ("at", "running")

    def __init__(self) -> None:
        self.at = array("d")
        self.running = array("d")

    def add(self, at: float, running: float) -> None:
        """Append a scrape (``at``: its ``updated_at``, seconds). One older than the last kept is
        ignored (a peer's shared scrape can be), so the times stay ascending."""
        if self.at and at < self.at[-1]:
            return
        if len(self.at) >= 2 * HISTORY:  # drop the older half: amortised O(1) a scrape
            del self.at[:HISTORY]
            del self.running[:HISTORY]
        self.at.append(at)
        self.running.append(running)

    def running_at(self, t: float) -> float:
        """The gauge at the last scrape at or before ``t`` (the oldest kept if none is; 0 if
        empty). A binary search: the scrape path runs it once an endpoint a scrape."""
        if not self.at:
            return 0.0
        i = bisect_right(self.at, t)
        return self.running[i - 1] if i else self.running[0]


def _running_at(hist: GaugeHistory, t: float, d: Delta) -> float:
    """The running gauge at the last scrape at or before ``t`` (the oldest kept if none is);
    the delta's mean when the replica gave no time (``d.ago_s < 0``)."""
    if d.ago_s < 0:
        return d.mean_running
    return hist.running_at(t)


def _idle(state: EndpointState, d: Delta) -> bool:
    """No work of the endpoint's own in the delta, and none in sight."""
    m = state.metrics
    busy = d.prefill_requests > 0 or d.itl_tokens > 0 or m.running + m.waiting > 0
    return not busy and state.load.in_flight_requests == 0


@dataclass
class Calibrator:
    """Turns successive scrapes into each endpoint's :class:`EndpointModel` (module docstring)."""

    cfg: CalibrationConfig = field(default_factory=CalibrationConfig)
    pool: Sums = field(default_factory=Sums)
    """The sum of every endpoint's sums; maintained incrementally."""
    _own: dict[str, Sums] = field(default_factory=dict)
    _last: dict[str, EndpointMetrics] = field(default_factory=dict)
    _idle_run: dict[str, int] = field(default_factory=dict)
    """Consecutive idle deltas per endpoint."""
    _running: dict[str, GaugeHistory] = field(default_factory=dict)
    """Per endpoint, the running gauge at its last scrapes (:class:`GaugeHistory`)."""

    def observe(self, state: EndpointState) -> None:
        """Fold ``state.metrics`` (just scraped) into the sums and refresh ``state.model``."""
        prev = self._last.get(state.key)
        self._last[state.key] = state.metrics
        hist = self._running.get(state.key)
        if hist is None:
            hist = self._running[state.key] = GaugeHistory()
        hist.add(state.metrics.updated_at, state.metrics.running)
        if prev is None:
            return
        d = delta(prev, state.metrics)
        if d is None:
            return
        own = self._own.get(state.key)
        if own is None:
            own = self._own[state.key] = Sums()
        self.pool.add(own, -1.0)
        own.decay(1.0 - 1.0 / self.cfg.window)
        self._fold(own, d, state.model, _running_at(hist, state.metrics.updated_at - d.ago_s, d))
        run = self._idle_run[state.key] = self._idle_run.get(state.key, 0) + 1 if _idle(state, d) else 0
        if run > self.cfg.idle_fade:
            own.pf_n *= 1.0 - 1.0 / self.cfg.idle_fade
            own.d_n *= 1.0 - 1.0 / self.cfg.idle_fade
        self.pool.add(own, 1.0)
        state.model = self.model_for(own)

    def forget(self, state: EndpointState) -> None:
        """The endpoint left the pool: its data leaves the pooled sums."""
        own = self._own.pop(state.key, None)
        self._last.pop(state.key, None)
        self._idle_run.pop(state.key, None)
        self._running.pop(state.key, None)
        if own is not None:
            self.pool.add(own, -1.0)

    def _fold(self, s: Sums, d: Delta, model: EndpointModel, b_pf: float) -> None:
        if d.itl_tokens > 0:
            # The decodes' mean wait: a step, plus the prefill tokens batched with them (p).
            w, b, y = d.itl_tokens, d.mean_running, d.itl_seconds / d.itl_tokens
            p = b * d.prefilled_tokens / d.itl_tokens
            y = min(y, self.cfg.max_step * (model.step_s(b) + p / model.prefill_rate))
            s.d_w += w
            s.d_wb += w * b
            s.d_wbb += w * b * b
            s.d_wy += w * y
            s.d_wby += w * b * y
            s.d_wp += w * p
            s.d_wbp += w * b * p
            s.d_wpp += w * p * p
            s.d_wpy += w * p * y
            s.d_n += 1
        if d.prefill_requests > 0 and d.uncached_tokens >= self.cfg.min_prefill_tokens:
            fixed = d.prefill_requests * model.step_s(b_pf)
            seconds = max(d.prefill_seconds - fixed, 0.1 * d.prefill_seconds)
            s.pf_seconds += min(seconds, self.cfg.max_step * d.uncached_tokens / model.prefill_rate)
            s.pf_tokens += d.uncached_tokens
            s.pf_requests += d.prefill_requests
            s.pf_n += 1

    def _step_line(self, s: Sums, rate: float) -> tuple[float, float, float] | None:
        """Weighted least squares ``y = a + c b + z p`` (all >= 0): ``(a, c, z)``.

        ``z`` is fit when ``p`` spreads by at least ``min_prefill_spread`` of its mean (standard
        deviation, net of what ``b`` explains); else it is ``1 / rate``. The slope ``c`` is fit
        when the batch sizes seen spread by at least ``min_batch_spread`` (standard deviation, in
        requests). With less spread a slope is noise (seen in tests: a 0.3–1.8 range of the
        gauge's mean gave a zero intercept and four times the true slope), so only the level is
        fit, ``y = L (1 + r b)``, with the shape ``r = batch_shape``."""
        if s.d_w <= 0:
            return None
        w = s.d_w
        mb, mp, my = s.d_wb / w, s.d_wp / w, s.d_wy / w
        sbb = s.d_wbb / w - mb * mb
        sbp = s.d_wbp / w - mb * mp
        spp = s.d_wpp / w - mp * mp
        sby = s.d_wby / w - mb * my
        spy = s.d_wpy / w - mp * my
        b_ok = sbb >= self.cfg.min_batch_spread**2
        p_net = spp - (sbp * sbp / sbb if b_ok else 0.0)
        p_ok = mp > 0 and p_net >= (self.cfg.min_prefill_spread * mp) ** 2
        if p_ok and b_ok:
            det = sbb * spp - sbp * sbp
            c = (sby * spp - spy * sbp) / det
            z = (spy * sbb - sby * sbp) / det
            a = my - c * mb - z * mp
            if a >= 0 and c >= 0 and z >= 0:
                return a, c, z
        r = self.cfg.batch_shape
        # Level form: q = 1 + r b, y = L q + z p.
        qq = w + 2 * r * s.d_wb + r * r * s.d_wbb
        qy = s.d_wy + r * s.d_wby
        qp = s.d_wp + r * s.d_wbp
        if p_ok:
            det = qq * s.d_wpp - qp * qp
            if det > 0:
                level = (qy * s.d_wpp - s.d_wpy * qp) / det
                z = (s.d_wpy * qq - qy * qp) / det
                if level >= 0 and z >= 0:
                    return level, level * r, z
        z = 1.0 / rate
        if b_ok:
            # y' = y - z p: the line through the decodes' waits less the prefill at 1 / rate.
            slope = max(0.0, (sby - z * sbp) / sbb)
            base = my - z * mp - slope * mb
            if base >= 0:
                return base, slope, z
        level = max(0.0, (qy - z * qp) / qq) if qq > 0 else 0.0
        return level, level * r, z

    def _shrunk(self, raw: float, n: float) -> float:
        cap = self.cfg.max_factor
        raw = min(max(raw, 1.0 / cap), cap)
        log_f = math.log(raw) * n / (n + self.cfg.prior_scrapes)
        return 1.0 if abs(log_f) < self._dead_band else math.exp(log_f)

    @property
    def _dead_band(self) -> float:
        return math.log1p(self.cfg.factor_dead_band)

    def _source(self, n: float) -> str:
        if n < self.cfg.prior_scrapes:
            return f"pooled across endpoints ({n:.0f} own scrapes)"
        return f"calibrated from {n:.0f} scrapes"

    def model_for(self, own: Sums) -> EndpointModel:
        cfg, pool = self.cfg, self.pool
        out = cfg.default_model()
        pool_rate = pool.pf_tokens / pool.pf_seconds if pool.pf_tokens > 0 and pool.pf_seconds > 0 else 0.0
        line = self._step_line(pool, pool_rate or cfg.default_prefill_rate)
        if line is not None:
            base, slope, z = line
            factor = 1.0
            predicted = base * own.d_w + slope * own.d_wb + z * own.d_wp
            if own.d_n and predicted > 0:
                factor = self._shrunk(own.d_wy / predicted, own.d_n)
            out.step_base_s, out.step_per_seq_s = base * factor, slope * factor
            out.step_source = self._source(own.d_n)
        if pool.pf_tokens > 0 and pool.pf_seconds > 0:
            rate = pool.pf_tokens / pool.pf_seconds
            if own.pf_n and own.pf_seconds > 0:
                rate *= self._shrunk((own.pf_tokens / own.pf_seconds) / rate, own.pf_n)
            out.prefill_rate = rate
            out.prefill_source = self._source(own.pf_n)
            reqs = own.pf_requests if own.pf_n >= cfg.prior_scrapes else pool.pf_requests
            toks = own.pf_tokens if own.pf_n >= cfg.prior_scrapes else pool.pf_tokens
            out.uncached_per_request = toks / reqs if reqs > 0 else out.uncached_per_request
        return out
