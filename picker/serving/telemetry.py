"""The picker's own Prometheus metrics (GIE names where the meaning is the same).

Those counted per request (outcomes, pick and plugin latencies, hit ratio, message kinds) are
plain numbers (:mod:`picker.serving.tally`), collected at scrape time; the rest (gauges mirrored
from state at scrape time, scrape errors) are prometheus_client's own metric classes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from picker.core.endpoints.pool import Pool
from picker.core.prefix.index import PrefixIndex
from picker.serving.tally import Count, Observations, Tally

_LAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


MAX_MODEL_LABELS = 256
"""Distinct ``model_name`` label values kept on ``inference_objective_request_total``; later ones
count as "other" (client-chosen names must not grow the registry without bound)."""
MAX_LABEL_CHARS = 128
"""A model name longer than this is cut to it in a label value."""
OTHER = "other"
"""The label value of every model name that is neither configured nor served by a replica."""


def model_label(name: str, known: Callable[[str], bool]) -> str:
    """``name`` as a label value: :data:`OTHER` unless ``known(name)`` (configured, or served by a
    replica), else cut to :data:`MAX_LABEL_CHARS` with every unprintable character (NUL, control
    characters, line breaks) replaced by ``?``. A client's name never becomes a label by itself:
    a 1 MiB or NUL-laden ``model`` costs the exposition one "other"."""
    if not name or not known(name):
        return OTHER
    name = name[:MAX_LABEL_CHARS]
    return name if name.isprintable() else "".join(c if c.isprintable() else "?" for c in name)


def _nothing_known(name: str) -> bool:
    return False


class InboxCounts(Protocol):
    """What the telemetry mirrors of the message inbox (:class:`picker.feeds.drain.Inbox`)."""

    reads: dict[str, int]
    messages: int
    short: int


class ScrapeCounts(Protocol):
    """What the telemetry mirrors of the scraper (:class:`picker.feeds.scrape.Scraper`)."""

    own_scrapes: int
    peer_outcomes: int

    def scrapes_here(self, key: str) -> bool: ...


class FlowCounts(Protocol):
    """What the telemetry mirrors of flow control (:class:`picker.serving.flow.FlowGate`)."""

    def depths(self) -> dict[int, tuple[int, int]]: ...

    def counts(self) -> dict[tuple[int, str], int]: ...

    def saturation(self) -> float: ...


class TokenizeCounts(Protocol):
    """What the telemetry mirrors of the local tokenizer (:class:`picker.core.tokenize.PromptTokenizer`)."""

    @property
    def approximate(self) -> dict[str, int]: ...


class Telemetry:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        pool_name: str = "kvpick",
        inbox: InboxCounts | None = None,
        scraper: ScrapeCounts | None = None,
        known_model: Callable[[str], bool] = _nothing_known,
    ) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.pool_name = pool_name
        self.known_model = known_model
        """Whether a model name may be a label value (configured, or served by a replica); the
        others count as :data:`OTHER` (:func:`model_label`)."""
        self.extension_points: dict[str, str] = {}
        """Plugin name → GIE extension point (Filter, Scorer, Picker), for the plugin histogram;
        filled before the first request (a plugin's child is bound on its first timing)."""
        self._plugin_children: dict[str, Observations] = {}
        """Plugin name → its bound histogram child: a ``labels()`` lookup costs more than the
        observation, and each pick times about six plugins. Bounded by the configured plugins."""
        self._objective_children: dict[tuple[str, str], Count] = {}
        """(model, target model) → bound counter child, for known names only (their own label
        values): at most ``MAX_MODEL_LABELS``. Other names are mapped on each request."""
        tally = self.tally = Tally()
        """The per-request metrics (:mod:`picker.serving.tally`): counted in plain numbers on the
        event loop, turned into metric families when ``/metrics`` is read."""
        self.requests = tally.counter(
            "kvpick_requests", "Requests by decision and outcome", ["decision", "outcome"]
        )
        """Labels bounded by the code: a decision (``prefix_hit``, ``prefix_miss``, ``bodiless``,
        ``rejected``, ``none``, with the response's status class where seen) and an outcome."""
        self.served = tally.counter(
            "kvpick_served_reports",
            "Served endpoints Envoy reported on the response path (x-gateway-destination-endpoint-"
            "served), by whether the picker's primary served, or another endpoint it was credited to",
            ["served"],
        )
        self.served_primary, self.served_other = self.served.labels("primary"), self.served.labels("other")
        self.e2e = tally.histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency (parse, hash, score, pick)",
            _LAT_BUCKETS,
        ).labels()
        self.plugin = tally.histogram(
            "inference_extension_plugin_duration_seconds",
            "Plugin processing latency per extension point, plugin type and plugin name",
            _LAT_BUCKETS,
            ["extension_point", "plugin_type", "plugin_name"],
        )
        """One series per configured plugin."""
        self.objective_requests = tally.counter(
            "inference_objective_request_total",
            "Requests picked for, by model and target model",
            ["model_name", "target_model_name"],
        )
        """At most ``MAX_MODEL_LABELS`` (model, target) pairs, then "other"."""
        self.prefix_hit_ratio = tally.histogram(
            "inference_extension_prefix_indexer_hit_ratio",
            "Fraction of a request's prefix blocks found on the chosen endpoint",
            (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
        ).labels()
        self.pd_decisions = tally.counter(
            "kvpick_pd_decisions",
            "P/D picks (pd.enabled) by outcome: disaggregated, local (the decider kept the prefill on the "
            "decode pod) or no_prefill_endpoint (none routable, or a both-role destination)",
            ["decision"],
        )
        """Three series at most (the label values in the help)."""
        self.extproc_messages = tally.counter(
            "kvpick_extproc_messages",
            "ext_proc messages received from Envoy, by kind (request_headers, request_body, ...)",
            ["kind"],
        )
        """One series per ext_proc message kind (``picker.serving.extproc.MESSAGE_KINDS``)."""
        self.avg_kv = Gauge(
            "inference_pool_average_kv_cache_utilization",
            "Average KV-cache utilization (0-1) over the pool's routable endpoints",
            ["name"],
            registry=r,
        )
        self.avg_queue = Gauge(
            "inference_pool_average_queue_size",
            "Average waiting requests over the pool's routable endpoints",
            ["name"],
            registry=r,
        )
        self.prefix_size = Gauge(
            "inference_extension_prefix_indexer_size",
            "Blocks held in the approximate prefix index",
            registry=r,
        )
        self.ready_pods = Gauge(
            "inference_pool_ready_pods", "Routable endpoints in the pool", ["name"], registry=r
        )
        self.in_flight = Gauge(
            "kvpick_endpoint_in_flight_requests", "In-flight requests", ["endpoint"], registry=r
        )
        self.in_flight_tokens = Gauge(
            "kvpick_endpoint_in_flight_tokens",
            "Prompt tokens of in-flight requests",
            ["endpoint"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "kvpick_scrape_errors",
            "Failed /metrics scrapes (ours, or shared by the peer picker that scrapes the endpoint)",
            ["endpoint", "reason"],
            registry=r,
        )
        self.scrapes = Counter(
            "kvpick_scrape_outcomes",
            "Scrape outcomes applied, by source: own (scraped here) or peer (shared by its owner)",
            ["source"],
            registry=r,
        )
        self.scrape_owner = Gauge(
            "kvpick_scrape_owner",
            "1 where this picker scrapes the endpoint for its peers, 0 where a peer does",
            ["endpoint"],
            registry=r,
        )
        self.inbox_reads = Counter(
            "kvpick_message_reads",
            "Reads of the KV-event and peer sockets, by trigger: pick (before each pick), message "
            "(one arrived after a quiet interval) or timer (dense traffic, once per --message-interval)",
            ["trigger"],
            registry=r,
        )
        self.inbox_messages = Counter(
            "kvpick_messages_read", "KV-event batches and peer messages taken by those reads", registry=r
        )
        self.inbox_short = Counter(
            "kvpick_message_reads_behind",
            "Reads that left a socket with more than 256 messages queued (a flood: the rest follows)",
            registry=r,
        )
        self.flow_waits = tally.histogram(
            "flow_control_request_queue_duration_seconds",
            "Time requests spent in flow control, from enqueue to their outcome (docs/flow-control.md)",
            (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            ["priority", "outcome"],
        )
        """Labels bounded by the configured priorities and the outcomes of docs/flow-control.md."""
        self.flow_requests = Counter(
            "flow_control_requests",
            "Requests that left flow control, by outcome and priority (docs/flow-control.md)",
            ["outcome", "priority"],
            registry=r,
        )
        self.flow_queue_size = Gauge(
            "flow_control_queue_size", "Requests held in the flow-control queue", ["priority"], registry=r
        )
        self.flow_queue_bytes = Gauge(
            "flow_control_queue_bytes",
            "Request body bytes held in the flow-control queue",
            ["priority"],
            registry=r,
        )
        self.flow_saturation = Gauge(
            "flow_control_pool_saturation",
            "min over endpoints of (predicted queue time / one typical request's prefill and step): "
            "1 or more is saturated, and requests wait in the picker",
            registry=r,
        )
        self.flow: FlowCounts | None = None
        """The flow control whose queue :meth:`refresh` mirrors (None: off). Writer: the gate."""
        self._flow_seen: dict[tuple[int, str], int] = {}
        self.tokenize_approximate = Counter(
            "kvpick_tokenize_approximate",
            "Requests precise mode could not tokenize as vLLM will (matched approximately), by reason: "
            "previous_response, media, tool_use_id, thinking, unsupported, template (docs/precise.md)",
            ["reason"],
            registry=r,
        )
        """Label values bounded by ``picker.core.tokenize.apis.REASONS``."""
        self.tokenizer: TokenizeCounts | None = None
        """The local tokenizer whose fallbacks :meth:`refresh` mirrors (None: none); set by the
        server once tokenization is built."""
        self._tokenize_seen: dict[str, int] = {}
        r.register(tally)
        self.inbox = inbox
        """The inbox whose counts :meth:`refresh` mirrors (None: no inbox metrics)."""
        self._inbox_seen: tuple[dict[str, int], int, int] = ({}, 0, 0)
        self.scraper = scraper
        """The scraper whose counts and ownership :meth:`refresh` mirrors (None: none)."""
        self._scrapes_seen = (0, 0)

    def plugin_timer(self, name: str, seconds: float) -> None:
        child = self._plugin_children.get(name)
        if child is None:
            point = self.extension_points.get(name, "Plugin")
            child = self._plugin_children[name] = self.plugin.labels(point, name, name)
        child.observe(seconds)

    def count_request(self, model: str, target_model: str) -> None:
        """One picked request (``inference_objective_request_total``). Label values are bounded
        in number (``MAX_MODEL_LABELS``), in kind (configured or served names, else "other") and
        in length and content (:func:`model_label`)."""
        key = (model, target_model)
        child = self._objective_children.get(key)
        if child is None:
            labels = (model_label(model, self.known_model), model_label(target_model, self.known_model))
            series = self.objective_requests.series
            if labels not in series and len(series) >= MAX_MODEL_LABELS:
                labels = (OTHER, OTHER)
            child = self.objective_requests.labels(*labels)
            if labels == key:  # a known name, its own label: cache it (bounded by the series)
                self._objective_children[key] = child
        child.inc()

    def refresh(self, pool: Pool, index: PrefixIndex) -> None:
        """Update the gauges that mirror state (called on each metrics scrape of the picker)."""
        self.prefix_size.set(index.size())
        ready = 0
        kv = queue = 0.0
        live = set()
        for s in pool:
            if s.routable:
                ready += 1
                kv += s.metrics.kv_usage
                queue += s.metrics.waiting
            live.add(s.key)
            self.in_flight.labels(s.key).set(s.load.in_flight_requests)
            self.in_flight_tokens.labels(s.key).set(s.load.in_flight_tokens)
        if self.scraper is not None:
            self._mirror_scrapes(self.scraper, live)
        if self.inbox is not None:
            self._mirror_inbox(self.inbox)
        if self.flow is not None:
            self._mirror_flow(self.flow)
        if self.tokenizer is not None:
            counts = dict(self.tokenizer.approximate)
            for reason, n in counts.items():
                self.tokenize_approximate.labels(reason).inc(n - self._tokenize_seen.get(reason, 0))
            self._tokenize_seen = counts
        self.ready_pods.labels(self.pool_name).set(ready)
        self.avg_kv.labels(self.pool_name).set(kv / ready if ready else 0.0)
        self.avg_queue.labels(self.pool_name).set(queue / ready if ready else 0.0)
        for gauge in (self.in_flight, self.in_flight_tokens, self.scrape_owner):
            for labels in list(gauge._metrics):  # drop series of departed endpoints
                if labels[0] not in live:
                    gauge.remove(*labels)

    def _mirror_inbox(self, inbox: InboxCounts) -> None:
        reads, messages, short = self._inbox_seen
        for trigger, n in inbox.reads.items():
            self.inbox_reads.labels(trigger).inc(n - reads.get(trigger, 0))
        self.inbox_messages.inc(inbox.messages - messages)
        self.inbox_short.inc(inbox.short - short)
        self._inbox_seen = (dict(inbox.reads), inbox.messages, inbox.short)

    def _mirror_flow(self, flow: FlowCounts) -> None:
        for band, (n, size) in flow.depths().items():
            self.flow_queue_size.labels(str(band)).set(n)
            self.flow_queue_bytes.labels(str(band)).set(size)
        counts = flow.counts()
        for (band, label), n in counts.items():
            self.flow_requests.labels(label, str(band)).inc(n - self._flow_seen.get((band, label), 0))
        self._flow_seen = dict(counts)
        self.flow_saturation.set(flow.saturation())

    def _mirror_scrapes(self, scraper: ScrapeCounts, live: set[str]) -> None:
        own, peer = scraper.own_scrapes, scraper.peer_outcomes
        self.scrapes.labels("own").inc(own - self._scrapes_seen[0])
        self.scrapes.labels("peer").inc(peer - self._scrapes_seen[1])
        self._scrapes_seen = (own, peer)
        for key in live:
            self.scrape_owner.labels(key).set(int(scraper.scrapes_here(key)))

    def forget(self, key: str) -> None:
        """Drop every series labelled with endpoint ``key`` (it left the pool): label cardinality
        stays bounded by the live endpoints."""
        for gauge in (self.in_flight, self.in_flight_tokens, self.scrape_owner):
            with contextlib.suppress(KeyError):
                gauge.remove(key)
        for labels in list(self.scrape_errors._metrics):  # (endpoint, reason)
            if labels[0] == key:
                with contextlib.suppress(KeyError):
                    self.scrape_errors.remove(*labels)
