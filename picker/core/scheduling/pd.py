"""Prefill/decode disaggregation: the ``pd`` profile handler and its deciders.

The wire protocol is llm-d's (``docs/disaggregation.md`` of llm-d-inference-scheduler): the
picker names the **decode** endpoint as the destination (the destination header and the
``envoy.lb`` metadata, as for any pick) and, when it disaggregates, the **prefill** endpoint in
the request header ``x-prefiller-host-port: ip:port``. The decode pod's sidecar
(``replica/pd_sidecar``, or llm-d's own ``pd-sidecar``) sends the prompt to that prefiller with
``max_tokens: 1`` and then the original request to its local vLLM with the returned
``kv_transfer_params``. Without the header the sidecar passes the request through.

One :meth:`PDHandler.run` per request:

1. the decode profile picks over the ``decode`` and ``both`` endpoints (the ``prefill`` ones
   never serve a request themselves);
2. the prefill profile picks, without committing, over the ``prefill`` endpoints: the best place
   for this prompt's prefill, cache- and load-aware (it runs before the decider, unlike llm-d's,
   because the model-driven decider compares the two pods);
3. the decider says whether to hand the prefill off.

Deciders (registry ``DECIDERS``; ``pd.decider`` in the config):

- ``cost`` (default): the calibrated load model (:mod:`picker.core.scheduling.cost`), in
  request-seconds (seconds of latency, summed over the requests that suffer them)::

      local    = ttft(D) + running(D) * own(D)
      ttft(D)  = (queued(D) + uncached(D)) / rate(D) + step(D, running(D))
      own(D)   = uncached(D) / rate(D)
      remote   = max(ttft(P) + transfer, queued(D) / rate(D)) + step(D, running(D))
      ttft(P)  = (queued(P) + uncached(P)) / rate(P) + step(P, running(P))
      transfer = uncached(D) * kv_bytes_per_token / link_bytes_per_s

  and disaggregates when ``remote < local``. ``queued``, ``running``, ``rate`` and ``step`` are
  the cost scorer's (:func:`~picker.core.scheduling.cost.queued_and_running`, each pod's own
  calibrated model): ``ttft(P)`` is the prefill pod's predicted queue plus this prompt's part it
  lacks. ``running(D) * own(D)`` is the interruption of ``D``'s decodes: while ``D`` prefills
  the prompt itself (chunked prefill shares every step with the batch), each of the
  ``running(D)`` requests in its batch gets one token per prefill chunk instead of one per
  decode step, so each finishes about ``own(D)`` seconds later: ``running(D)`` requests ×
  ``own(D)`` seconds, the same unit as the request's own TTFT (one second of any request's
  latency counts once; no weight). On the remote path the KV of the part ``D`` lacks crosses
  the link, then the request joins ``D``'s batch behind whatever ``D`` still has queued; it
  adds one sequence to ``D``'s steps, ``step_per_seq`` per token, which the rule neglects. A
  prefix already cached on ``D`` makes ``own(D)`` small, so ``local`` wins by itself; an idle
  ``D`` (``running`` 0) stalls nobody, so the request's TTFT alone decides.
- ``token-threshold``: llm-d's ``prefix-based-pd-decider``: disaggregate when the prompt's
  uncached part on ``D`` is at least ``threshold_tokens``. For comparison.
- ``always`` / ``never``: for benchmarks.

Pure: no I/O; reads endpoint states only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from picker.core.endpoints.types import BOTH, DECODE, PREFILL, EndpointState
from picker.core.errors import PickerError
from picker.core.scheduling.cost import queued_and_running
from picker.core.scheduling.profile import Profile, Result
from picker.core.scheduling.types import Cycle

PREFILLER_HEADER = "x-prefiller-host-port"
"""The request header naming the prefill endpoint (``ip:port``), llm-d's ``PrefillPodHeader``."""

DEFAULT_KV_BYTES_PER_TOKEN = 131_072
"""KV bytes per token of Llama-3.1-8B in bf16: 2 (K and V) × 32 layers × 8 KV heads × 128 dims
× 2 bytes (the model's config.json)."""
DEFAULT_LINK_BYTES_PER_S = 50e9
"""50 GB/s: one 400 Gb/s NIC per GPU (ConnectX-7, InfiniBand NDR or RoCE), as in a DGX H100
(8 × 400 Gb/s compute NICs, NVIDIA's DGX H100 user guide)."""


@dataclass(frozen=True, slots=True)
class Link:
    """How KV crosses between a prefill and a decode pod."""

    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S

    def transfer_s(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class Verdict:
    """A decider's answer, with its estimates in seconds (0 where the decider has none)."""

    disaggregate: bool
    local_s: float = 0.0
    remote_s: float = 0.0
    reason: str = ""


class Decider(Protocol):
    def decide(self, cycle: Cycle, decode: EndpointState, prefill: EndpointState, link: Link) -> Verdict:
        """Whether ``prefill`` should prefill the request that ``decode`` will decode."""
        ...


def _uncached(cycle: Cycle, e: EndpointState) -> int:
    return cycle.prompt_tokens - cycle.cached_tokens(e.key)


@dataclass
class CostDecider:
    """Disaggregate when the predicted TTFT through the prefill pod, KV transfer included, beats
    prefilling on the decode pod plus the delay that prefill imposes on each of the decode pod's
    running requests; all in request-seconds (the module doc). No parameters: both sides count
    seconds of some request's latency, once each."""

    def decide(self, cycle: Cycle, decode: EndpointState, prefill: EndpointState, link: Link) -> Verdict:
        d_model, p_model = decode.model, prefill.model
        d_queued, d_running = queued_and_running(decode)
        p_queued, p_running = queued_and_running(prefill)
        d_uncached = _uncached(cycle, decode)
        p_uncached = _uncached(cycle, prefill)
        d_step = d_model.step_s(d_running)
        own = d_uncached / d_model.prefill_rate
        local = d_queued / d_model.prefill_rate + own + d_step + d_running * own
        p_ttft = (p_queued + p_uncached) / p_model.prefill_rate + p_model.step_s(p_running)
        ready = max(p_ttft + link.transfer_s(d_uncached), d_queued / d_model.prefill_rate)
        remote = ready + d_step
        return Verdict(remote < local, local, remote, "cost")


@dataclass
class TokenThresholdDecider:
    """llm-d's ``prefix-based-pd-decider``: the prompt's uncached part on the decode pod is at
    least ``threshold_tokens`` (0: always)."""

    threshold_tokens: int = 512

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError(f"token-threshold: threshold_tokens must be >= 0, got {self.threshold_tokens}")

    def decide(self, cycle: Cycle, decode: EndpointState, prefill: EndpointState, link: Link) -> Verdict:
        return Verdict(_uncached(cycle, decode) >= self.threshold_tokens, reason="token-threshold")


@dataclass
class AlwaysDecider:
    def decide(self, cycle: Cycle, decode: EndpointState, prefill: EndpointState, link: Link) -> Verdict:
        return Verdict(True, reason="always")


@dataclass
class NeverDecider:
    def decide(self, cycle: Cycle, decode: EndpointState, prefill: EndpointState, link: Link) -> Verdict:
        return Verdict(False, reason="never")


@dataclass(frozen=True)
class PDConfig:
    """``pd:`` in the config file (docs/pd.md)."""

    enabled: bool = False
    """Run the ``pd`` profile handler: pick a decode endpoint, then maybe a prefill endpoint.
    Off: roles are ignored and every endpoint serves whole requests."""
    decode_policy: str = ""
    """The profile that picks the decode endpoint ("" : ``policy``)."""
    prefill_policy: str = ""
    """The profile that picks the prefill endpoint ("" : ``policy``)."""
    decider: str = "cost"
    """``cost``, ``token-threshold``, ``always`` or ``never`` (the module doc)."""
    decider_params: dict[str, Any] = field(default_factory=dict)
    """The decider's parameters over its defaults (``token-threshold``: ``threshold_tokens``;
    ``cost`` has none)."""
    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    """The served model's KV cache bytes per token (default: Llama-3.1-8B, bf16)."""
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    """KV transfer bandwidth between a prefill and a decode pod, bytes/s (default 50 GB/s: one
    400 Gb/s NIC per GPU)."""

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError("pd.kv_bytes_per_token and pd.link_bytes_per_s must be > 0")

    @property
    def link(self) -> Link:
        return Link(self.kv_bytes_per_token, self.link_bytes_per_s)


@dataclass(slots=True)
class PDResult:
    """The prefill half of a P/D pick (the decode half is the ordinary :class:`Result`)."""

    prefill: EndpointState | None
    """The prefill endpoint when the decider disaggregated, else None."""
    verdict: Verdict | None
    """None when there was no prefill candidate (nothing to decide)."""


def split_roles(endpoints: Sequence[EndpointState]) -> tuple[list[EndpointState], list[EndpointState]]:
    """(decode candidates: ``decode`` and ``both``; prefill candidates: ``prefill``)."""
    decode = [e for e in endpoints if e.endpoint.role in (DECODE, BOTH)]
    prefill = [e for e in endpoints if e.endpoint.role == PREFILL]
    return decode, prefill


@dataclass
class PDHandler:
    """Decode first, then the prefill candidate, then the decider (the module doc)."""

    decider: Decider
    link: Link

    def run(
        self,
        cycle: Cycle,
        decode_profile: Profile,
        prefill_profile: Profile,
        decode_candidates: list[EndpointState],
        prefill_candidates: list[EndpointState],
        k: int,
        commit: bool = True,
        prune: bool = True,
    ) -> tuple[Result, PDResult]:
        """Raises :class:`~picker.core.errors.NoEndpoints` when no decode candidate survives the
        decode profile's filters; with no prefill candidate left, the request is not disaggregated.
        ``prune``: as :meth:`Profile.run`'s."""
        result = decode_profile.run(cycle, decode_candidates, k, commit, prune)
        if not prefill_candidates or result.chosen[0].endpoint.role == BOTH:
            # A ``both`` pod runs no sidecar (llm-d's roles): it prefills its own requests.
            return result, PDResult(None, None)
        try:
            pre = prefill_profile.run(cycle, prefill_candidates, 1, commit=False, prune=prune)
        except PickerError:  # the prefill profile's filters left none (or would shed): decode locally
            return result, PDResult(None, None)
        p = pre.chosen[0]
        verdict = self.decider.decide(cycle, result.chosen[0], p, self.link)
        return result, PDResult(p if verdict.disaggregate else None, verdict)
