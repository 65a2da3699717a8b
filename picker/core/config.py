"""Configuration: dataclasses with defaults, overlaid by a YAML file, overlaid by flags.

Example ``--config-file``::

    policy: cost
    hashing: {block_size: 64, max_blocks: 2048}
    index: {capacity_blocks: 31250, segments: 4, chars_per_token: 4.0, max_derived_capacity_blocks: 1000000}
    objectives: {critical: 10, batch: -1}   # x-gateway-inference-objective -> priority (<0 sheddable)
    trust_gateway_headers: false           # honour x-gateway-model-name-rewrite (gateway sets it)
    fallbacks: 0           # 2 behind an override_host upstream (deploy/envoy/envoy-fallback.yaml)
    max_body_bytes: 8388608
    scrape: {interval_s: 0.2, timeout_s: 1.0, stale_after_s: 2.0, unreachable_after: 3}
    prefix: {mode: auto, kv_events_port: 5557, tokenizer: /models/llama}   # precise: KV events
    calibration: {default_prefill_rate: 10000, prior_scrapes: 8, window: 64}   # picker.core.calibration
    pd: {enabled: true, decider: cost, link_bytes_per_s: 5.0e10}   # prefill/decode disaggregation (docs/pd.md)
    profiles:              # add or override policies; built-ins: cost, round-robin, least-loaded
      my-policy:
        filters: [{type: ready}, {type: not-saturated, params: {max_waiting: 32}}]
        scorers: [{type: prefix, weight: 2}, {type: queue, weight: 1}]
        picker: {type: max-score}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

from picker.core.calibration import CalibrationConfig
from picker.core.flowcontrol import FlowControlConfig
from picker.core.prefix.hashing import HashConfig
from picker.core.request import DEFAULT_MEDIA_TOKENS
from picker.core.scheduling.pd import PDConfig
from picker.core.scheduling.profile import BUILTIN_POLICIES, Profile
from picker.core.scheduling.registry import make_decider, make_filter, make_picker, make_scorer


@dataclass(frozen=True)
class IndexConfig:
    capacity_blocks: int = 31_250
    """Default per-endpoint LRU capacity, in hash blocks; replaced per endpoint by the capacity
    derived from its ``vllm:cache_config_info`` once scraped (``derive_capacity``)."""
    segments: int = 4
    """Segments of each endpoint's LRU (a segmented LRU: a block hit again moves up a segment)."""
    chars_per_token: float = 4.0
    """Characters of prompt text per token, to turn text blocks into token counts (approximate mode)."""
    derive_capacity: bool = True
    """Size each endpoint's LRU from its scraped ``vllm:cache_config_info`` (block size × GPU
    blocks, in hash blocks, times ``segments / (segments - 1)``: the LRU drops its oldest segment
    whole, so it then always keeps at least the engine's KV) instead of ``capacity_blocks``."""
    max_derived_capacity_blocks: int = 1_000_000
    """Upper bound on a derived capacity, in hash blocks (about 88 MB of index per endpoint at
    ~88 B per entry): a replica reporting a huge ``num_gpu_blocks`` cannot make its LRU unbounded.
    Generous on purpose: 1M blocks of 64 characters is about 16M tokens of KV cache."""

    def __post_init__(self) -> None:
        if self.max_derived_capacity_blocks < self.segments:
            raise ValueError(
                f"index.max_derived_capacity_blocks must be >= segments ({self.segments}), "
                f"got {self.max_derived_capacity_blocks}"
            )


@dataclass(frozen=True)
class ScrapeConfig:
    interval_s: float = 0.2
    """Seconds between two scrapes of one endpoint's ``/metrics``."""
    timeout_s: float = 1.0
    """Seconds one scrape may take before it counts as failed."""
    stale_after_s: float = 2.0
    """With no successful scrape for this long an endpoint is DEGRADED (still routable); with
    several pickers, also how long a scrape's owner may stay silent before a peer scrapes it itself."""
    unreachable_after: int = 3
    """Consecutive failed scrapes before an endpoint is marked unreachable."""
    health_path: str = "/health"
    """Probed with every scrape; a non-2xx answer (other than 404: no such route) marks the
    endpoint UNHEALTHY at once. "" turns the probe off."""
    stall_after_s: float = 10.0
    """An endpoint that is busy (requests in flight, or running/waiting > 0) while its engine
    counters do not move for this long is STALLED (not routable) until they move. 0: off."""


PREFIX_MODES = ("approximate", "precise", "auto")


@dataclass(frozen=True)
class PrefixConfig:
    """Where prefix matches come from (docs/routing.md#approximate-and-precise-prefix-matching).

    - ``approximate``: the picker's own record of what it sent where (text blocks, per-endpoint LRU).
    - ``precise``: the replicas' KV events (token blocks as the engine caches them) for every
      endpoint not re-syncing after an unrecoverable gap; approximate for the rest.
    - ``auto``: precise for endpoints whose events have been seen in order, approximate otherwise.
    Precise matching needs token ids: the request's own, or ``tokenizer`` (a directory holding
    ``tokenizer.json`` and ``tokenizer_config.json``, or a ``tokenizer.json`` path)."""

    mode: str = "approximate"
    """``approximate``, ``precise`` or ``auto`` (above)."""
    kv_events_port: int = 5557
    """vLLM's ``--kv-events-config`` ``endpoint`` port, the same on every replica."""
    kv_events_replay_port: int = 0
    """vLLM's ``replay_endpoint`` port (0: no replay; a gap then drops the endpoint's entries)."""
    data_parallel_ports: tuple[int, ...] = ()
    """Serving ports of data-parallel ranks 0..N-1 on one host (vLLM publishes rank r's events on
    ``kv_events_port + r`` and replays them on ``kv_events_replay_port + r``): an endpoint on the
    r-th of these ports is subscribed at its rank's ports; any other endpoint at the base ports."""
    kv_events_topic: str = ""
    """Topic prefix subscribed to ("" takes every topic)."""
    block_size: int = 0
    """Tokens per KV block; 0 learns it from the events (they carry it)."""
    speculative_ttl_s: float = 2.0
    """How long a pick counts as cached on its endpoint before the replica's events confirm it."""
    refill_s: float = 30.0
    """After a gap without replay, how long an endpoint is routed approximately."""
    max_blocks_per_endpoint: int = 1_000_000
    """Bound on indexed blocks per endpoint (about 150 B each); past it the endpoint is dropped."""
    tokenizer: str = ""
    """The model's tokenizer for precise matching of text prompts: a directory holding
    ``tokenizer.json`` and ``tokenizer_config.json``, or a ``tokenizer.json`` path ("": none)."""
    tokenizer_cache_entries: int = 64
    """Texts whose tokenization is kept for reuse by requests sharing their prefix (0: off; off
    for a tokenizer that does not split words at whitespace, see ``picker.core.tokenize.cache``)."""
    tokenizer_cache_tokens: int = 1 << 20
    """Bound on the token ids the tokenization cache holds in all (12 bytes each with their
    offsets: 4 for the id, 8 for its end offset, in arrays; 12 MiB at the default, plus their
    block keys and the texts they came from)."""
    progressive_chars: int = 65536
    """Prompts whose text is at least this long are tokenized progressively: a first chunk of
    ``tokenize_chunk_chars``, then chunks twice as long, each only while some endpoint holds every
    block so far; the rest of the prompt's length is estimated (docs/precise.md)."""
    tokenize_chunk_chars: int = 16384
    """The first chunk of a progressive tokenization, in characters."""
    max_prompt_tokens: int = 1 << 20
    """Bound on one request's token ids: a progressive tokenization stops past it (the rest is
    estimated), so no request holds more than this plus one chunk's ids."""
    tokenize_inline_bytes: int = 4096
    """Bodies under this many bytes are tokenized on the event loop, larger ones in a thread (0:
    always in a thread). The thread hop costs two wake-ups (the worker's, then the loop's), each
    of which can wait for a core the engines hold; for a short prompt that costs more than the
    tokenizing (figures: bench/results/real.md)."""
    precise_miss_penalty: float = 2.0
    """In a precise cycle (the KV events say what each endpoint holds), every ``cost`` scorer left
    at its default ``miss_penalty`` (1.0) charges a miss this much instead: an exact miss is a
    second copy of a prefix that another endpoint really holds, where an approximate one may be
    a guess (cluster-mode figures: bench/results/pickers.md). 1.0: as in approximate mode."""
    remote_tokenize: bool = True
    """Without ``tokenizer``, ask a ready replica's vLLM ``/tokenize`` for the prompt's ids
    (``picker.feeds.remote_tokenizer``); false: such text prompts are matched approximately."""
    remote_tokenize_timeout_s: float = 0.5
    """Longest wait for a replica's ``/tokenize``; past it the request is matched approximately."""
    remote_tokenize_cache_entries: int = 256
    """Request bodies whose remote token ids are kept, so a repeated prompt costs no round trip."""

    @property
    def tokenizes(self) -> bool:
        """Whether prompts are tokenized for precise matching: a precise mode with a local
        ``tokenizer`` or the remote ``/tokenize`` fallback (:mod:`picker.serving.tokenization`)."""
        return self.mode != "approximate" and bool(self.tokenizer or self.remote_tokenize)

    def __post_init__(self) -> None:
        if self.mode not in PREFIX_MODES:
            raise ValueError(f"prefix.mode must be one of {', '.join(PREFIX_MODES)}, got {self.mode!r}")
        if not 0 < self.kv_events_port < 65536 or not 0 <= self.kv_events_replay_port < 65536:
            raise ValueError("prefix.kv_events_port / kv_events_replay_port must be TCP ports")
        if self.block_size < 0 or self.speculative_ttl_s < 0 or self.refill_s < 0:
            raise ValueError("prefix.block_size, speculative_ttl_s and refill_s must be >= 0")
        if self.tokenizer_cache_entries < 0 or self.remote_tokenize_cache_entries < 0:
            raise ValueError("prefix.tokenizer_cache_entries and remote_tokenize_cache_entries must be >= 0")
        if self.precise_miss_penalty < 0:
            raise ValueError("prefix.precise_miss_penalty must be >= 0")
        if self.tokenize_inline_bytes < 0:
            raise ValueError("prefix.tokenize_inline_bytes must be >= 0")
        if (
            min(
                self.tokenizer_cache_tokens,
                self.progressive_chars,
                self.tokenize_chunk_chars,
                self.max_prompt_tokens,
            )
            < 1
        ):
            raise ValueError(
                "prefix.tokenizer_cache_tokens, progressive_chars, tokenize_chunk_chars and max_prompt_tokens must be >= 1"
            )
        if self.remote_tokenize_timeout_s <= 0:
            raise ValueError("prefix.remote_tokenize_timeout_s must be > 0")
        object.__setattr__(self, "data_parallel_ports", tuple(self.data_parallel_ports))  # YAML gives a list
        if len(set(self.data_parallel_ports)) != len(self.data_parallel_ports) or not all(
            isinstance(p, int) and 0 < p < 65536 for p in self.data_parallel_ports
        ):
            raise ValueError("prefix.data_parallel_ports must be distinct TCP ports")
        if self.max_blocks_per_endpoint < 1:
            raise ValueError("prefix.max_blocks_per_endpoint must be >= 1")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cost"
    """The profile that routes: a built-in policy or one under ``profiles``."""
    hashing: HashConfig = field(default_factory=HashConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    fallbacks: int = 0
    """Endpoints named after the primary. The destination header and the ``envoy.lb`` metadata
    carry the same value (the protocol forbids two), ``primary[,fallback…]``. Envoy's
    ORIGINAL_DST upstream (GIE's own test config, deploy/envoy/envoy.yaml) reads the header as
    one ``ip:port`` and routes nothing when it holds a list: keep 0 there. An ``override_host``
    upstream (deploy/envoy/envoy-fallback.yaml, Istio, GKE) takes the list and retries down it."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted, in bytes; a larger one is answered 413."""
    lora_adapters: frozenset[str] = frozenset()
    """Model names that are LoRA adapters: a request naming one is hashed with the adapter folded
    in (as vLLM's extra keys) and scored by ``lora-affinity``."""
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: dict(BUILTIN_POLICIES))
    """Policy name → ``{filters, scorers, picker}``, laid over the built-in policies."""
    objectives: Mapping[str, int] = field(default_factory=dict)
    """Objective name (``x-llm-d-inference-objective`` or ``x-gateway-inference-objective``) → priority, as InferenceObjective's
    ``priority``: negative is sheddable (429 when the pool is saturated), 0 or more is not."""
    default_priority: int = 0
    """Priority of a request naming no objective, or one not in ``objectives``."""
    media_tokens: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_MEDIA_TOKENS))
    """Token cost of one media part by kind (image, audio, video, file): a part counts this
    much prefill, never its base64 length, and is hashed by a digest of its content."""
    parse_offload_bytes: int = 512 * 1024
    """Bodies of at least this many bytes are parsed in a worker process, off the event loop
    (0: always inline)."""
    trust_gateway_headers: bool = False
    """Honour ``x-llm-d-model-name-rewrite`` (or ``x-gateway-model-name-rewrite``). Only a gateway may set it: turn this on only where
    the gateway strips a client-sent copy and sets its own (else any client picks the model)."""
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    """Prefill/decode disaggregation (:mod:`picker.core.scheduling.pd`, docs/pd.md)."""
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)
    """The gateway queue (:mod:`picker.core.flowcontrol`); YAML ``flowControl`` or ``flow_control``."""

    def __post_init__(self) -> None:
        if self.policy not in self.profiles:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(sorted(self.profiles))}")
        for key in ("decode_policy", "prefill_policy"):
            name = getattr(self.pd, key)
            if name and name not in self.profiles:
                raise ValueError(
                    f"pd.{key}: unknown policy {name!r}; known: {', '.join(sorted(self.profiles))}"
                )
        make_decider(self.pd.decider, self.pd.decider_params)  # a misspelt decider fails at load
        assert self.fallbacks >= 0, f"fallbacks must be >= 0, got {self.fallbacks}"


T = TypeVar("T")


def _overlay(cls: type[T], base: T, raw: Mapping[str, Any], where: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(raw) - set(fields)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(fields)}")
    return dataclasses.replace(base, **raw)  # type: ignore[type-var]


def load(raw: Mapping[str, Any] | None, base: RouterConfig | None = None) -> RouterConfig:
    """Overlay a parsed YAML mapping onto ``base`` (defaults when None)."""
    base = base or RouterConfig()
    raw = dict(raw or {})
    if "flowControl" in raw:  # llm-d's spelling
        if "flow_control" in raw:
            raise ValueError("config: flowControl and flow_control both given; use one")
        raw["flow_control"] = raw.pop("flowControl")
    sub = {
        "hashing": (HashConfig, base.hashing),
        "index": (IndexConfig, base.index),
        "scrape": (ScrapeConfig, base.scrape),
        "prefix": (PrefixConfig, base.prefix),
        "calibration": (CalibrationConfig, base.calibration),
        "pd": (PDConfig, base.pd),
        "flow_control": (FlowControlConfig, base.flow_control),
    }
    for key, (cls, cur) in sub.items():
        if key in raw:
            raw[key] = _overlay(cls, cur, raw[key] or {}, key)
    if "profiles" in raw:
        raw["profiles"] = {**base.profiles, **(raw["profiles"] or {})}
    if "objectives" in raw:
        raw["objectives"] = _objectives(raw["objectives"] or {})
    if "media_tokens" in raw:
        raw["media_tokens"] = {**base.media_tokens, **(raw["media_tokens"] or {})}
    if "lora_adapters" in raw:
        raw["lora_adapters"] = frozenset(raw["lora_adapters"] or ())
    return _overlay(RouterConfig, base, raw, "config")


def _objectives(raw: Mapping[str, Any]) -> dict[str, int]:
    """``{name: priority}`` or ``{name: {priority: n}}`` (InferenceObjective's spec shape)."""
    out: dict[str, int] = {}
    for name, v in raw.items():
        prio = v.get("priority", 0) if isinstance(v, Mapping) else v
        if not isinstance(prio, int) or isinstance(prio, bool):
            raise ValueError(f"objectives.{name}: priority must be an integer, got {prio!r}")
        out[str(name)] = prio
    return out


def load_file(path: str, base: RouterConfig | None = None) -> RouterConfig:
    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return load(raw, base)


def _check_keys(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def build_profile(name: str, spec: Mapping[str, Any]) -> Profile:
    """Instantiate a policy's plugins from its spec (``filters``, ``scorers``, ``picker``).
    Misspelt keys are errors: a silently ignored ``wieght`` would change routing unnoticed."""
    _check_keys(spec, {"filters", "scorers", "picker"}, f"profile {name!r}")
    for entry in [*spec.get("filters", []), *spec.get("scorers", []), spec.get("picker", {})]:
        _check_keys(entry, {"type", "params", "weight"}, f"profile {name!r} plugin")
    filters = [(f["type"], make_filter(f["type"], f.get("params"))) for f in spec.get("filters", [])]
    scorers = [
        (s["type"], make_scorer(s["type"], s.get("params")), float(s.get("weight", 1.0)))
        for s in spec.get("scorers", [])
    ]
    pk = spec.get("picker", {"type": "max-score"})
    return Profile(name, filters, scorers, (pk["type"], make_picker(pk["type"], pk.get("params"))))
