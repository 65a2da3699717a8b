"""Prefill/decode disaggregation in the core: roles, the ``pd`` handler, its deciders, accounting
on both pods, and the wire protocol (``x-prefiller-host-port`` + ``envoy.lb``) through the
ext_proc state machine (real protobuf messages, no network)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.core import config as config_mod
from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import BOTH, DECODE, PREFILL, EndpointMetrics, parse_role
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.core.scheduling.cost import CostScorer, queued_and_running
from picker.core.scheduling.pd import (
    PREFILLER_HEADER,
    CostDecider,
    Link,
    PDConfig,
    TokenThresholdDecider,
)
from picker.feeds.discovery.kube import PodView
from picker.feeds.discovery.static import parse_file_doc, parse_list
from picker.serving.extproc import BUFFERED, DEST_HEADER, FULL_DUPLEX, Exchange
from tests.support.picking import director

D1, D2, P1, P2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000", "10.0.1.2:8000"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(decider: str = "cost", roles: str = "", **params: object) -> tuple[Router, Pool, Clock]:
    pool = Pool()
    spec = roles or f"{D1}=decode,{D2}=decode,{P1}=prefill,{P2}=prefill"
    pool.set_endpoints(parse_list(spec))
    clock = Clock()
    cfg = RouterConfig(pd=PDConfig(enabled=True, decider=decider, decider_params=dict(params)))
    return Router(cfg, pool, clock=clock), pool, clock


def busy_decode(pool: Pool, running: int = 40) -> None:
    """Both decode pods report ``running`` requests."""
    for key in (D1, D2):
        s = pool.get(key)
        assert s is not None
        s.metrics = EndpointMetrics(running=running)


def req(text: str) -> InferenceRequest:
    return InferenceRequest(model="m", routing_text=text)


LONG = "a long document about tides and moons " * 120  # ~1100 tokens at 4 chars/token


# ---- roles ---------------------------------------------------------------------------------------


def test_roles_from_static_lists_files_and_pod_labels() -> None:
    eps = parse_list(f"{D1}=decode, {P1}=prefill, 10.0.0.9:80, [::1]:81=both")
    assert [e.role for e in eps] == [DECODE, PREFILL, BOTH, BOTH]
    assert eps[3].key == "[::1]:81"
    doc = {"endpoints": ["10.0.0.3:1=prefill", {"address": "10.0.0.4", "port": 2, "role": "decode"}]}
    assert [e.role for e in parse_file_doc(doc)] == [PREFILL, DECODE]
    assert parse_role(None) == parse_role("") == BOTH and parse_role(" Prefill ") == PREFILL
    for bad in ("10.0.0.1:80=encode", "10.0.0.1:80=pre fill"):
        with pytest.raises(ValueError):
            parse_list(bad)

    def pod(labels: dict[str, str]) -> PodView:
        return PodView("p", labels, "10.1.1.1", True)

    assert [e.role for e in pod({"llm-d.ai/role": "prefill"}).endpoints([8000, 8001])] == [PREFILL] * 2
    assert pod({"app": "x"}).endpoints([8000])[0].role == BOTH
    assert pod({"llm-d.ai/role": "encode"}).endpoints([8000]) == [], "a role we do not serve: not routed"


def test_a_role_change_reaches_the_pool_and_keeps_the_live_state() -> None:
    pool = Pool()
    pool.set_endpoints(parse_list(f"{D1}"))
    state = pool.get(D1)
    assert state is not None
    state.load.in_flight_requests = 3
    pool.set_endpoints(parse_list(f"{D1}=prefill"))
    assert pool.get(D1) is state and state.endpoint.role == PREFILL and state.load.in_flight_requests == 3


def test_config_rejects_unknown_deciders_params_and_policies() -> None:
    with pytest.raises(ValueError, match="unknown decider"):
        config_mod.load({"pd": {"enabled": True, "decider": "sometimes"}})
    with pytest.raises(ValueError, match="unknown params"):
        config_mod.load({"pd": {"decider": "cost", "decider_params": {"itl_wieght": 1}}})
    with pytest.raises(ValueError, match=r"pd\.prefill_policy"):
        config_mod.load({"pd": {"prefill_policy": "nope"}})
    with pytest.raises(ValueError, match="unknown keys"):
        config_mod.load({"pd": {"enable": True}})
    cfg = config_mod.load({"pd": {"enabled": True, "decider": "token-threshold", "link_bytes_per_s": 1e9}})
    assert cfg.pd.enabled and cfg.pd.link == Link(131_072, 1e9)


# ---- the handler ---------------------------------------------------------------------------------


def test_decode_first_over_decode_and_both_then_prefill_over_prefill_only() -> None:
    router, _, _ = make("always", roles=f"{D1}=decode,10.0.0.5:1=both,{P1}=prefill")
    seen_decode, seen_prefill = set(), set()
    for i in range(40):
        d = router.route(req(f"q{i} " + LONG))
        seen_decode.add(d.primary.key)
        if d.prefill is not None:
            seen_prefill.add(d.prefill.key)
            assert d.primary.endpoint.role == DECODE
        else:
            assert d.primary.endpoint.role == BOTH, "a decode pod always disaggregates under 'always'"
    assert seen_decode == {D1, "10.0.0.5:1"}, "prefill pods never serve a request themselves"
    assert seen_prefill == {P1}


def test_no_prefill_endpoint_routable_decodes_locally_and_pd_off_ignores_roles() -> None:
    router, pool, _ = make("always")
    for key in (P1, P2):
        s = pool.get(key)
        assert s is not None
        s.health = s.health.UNREACHABLE
    d = router.route(req(LONG))
    assert d.prefill is None and d.pd is not None and d.pd.verdict is None
    off = Router(RouterConfig(), pool)
    keys = {off.route(req(f"{i} {LONG}")).primary.key for i in range(40)}
    assert keys == {D1, D2}, "without pd the unreachable prefill pods are simply not routable"


def test_the_subset_hint_limits_the_decode_pod_not_the_prefill_pod() -> None:
    router, _, _ = make("always")
    for i in range(10):
        d = router.route(req(f"{i} {LONG}"), subset={D2})
        assert d.primary.key == D2 and d.prefill is not None and d.prefill.key in (P1, P2)


def test_the_prefill_pick_is_cache_aware() -> None:
    router, _, _ = make("always")
    first = router.route(req(LONG))
    router.finish(router.start(first))
    assert first.prefill is not None
    for _ in range(5):
        d = router.route(req(LONG + " and one more question"))
        assert d.prefill is not None and d.prefill.key == first.prefill.key, "the prefix's holder prefills it"


# ---- deciders ------------------------------------------------------------------------------------


def test_cost_decider_disaggregates_a_long_cold_prompt_on_a_busy_decode_pod() -> None:
    router, pool, _ = make("cost")
    busy_decode(pool)
    d = router.route(req(LONG))
    assert d.pd is not None and d.pd.verdict is not None
    assert d.prefill is not None, d.pd.verdict
    assert d.pd.verdict.remote_s < d.pd.verdict.local_s


def test_cost_decider_keeps_a_prefix_cached_on_the_decode_pod_local() -> None:
    """D holds the prompt (an idle D prefilled it itself), the prefill pods do not: the local
    prefill is the short tail, which stalls D's 40 running requests less than the prefill pod
    takes to compute the whole prompt."""
    router, pool, _ = make("cost")
    d0 = router.route(req(LONG))
    assert d0.prefill is None, "an idle decode pod: nobody to stall, local"
    router.finish(router.start(d0))
    busy_decode(pool)
    d = router.route(req(LONG + " q2"))
    assert d.primary.key == d0.primary.key, "the decode pick follows the cached prefix"
    assert d.prefill is None and d.pd is not None and d.pd.verdict is not None, d.pd
    assert d.pd.verdict.local_s <= d.pd.verdict.remote_s


def test_cost_decider_keeps_the_prefill_local_when_the_prefill_pods_are_backed_up() -> None:
    router, pool, _ = make("cost")
    for key in (P1, P2):
        s = pool.get(key)
        assert s is not None
        s.metrics = EndpointMetrics(waiting=60, running=8)  # ~30k queued tokens at 512 each: 3 s
    d = router.route(req(LONG))
    assert d.prefill is None and d.pd is not None and d.pd.verdict is not None
    assert d.pd.verdict.remote_s > d.pd.verdict.local_s


def test_cost_decider_weighs_the_stall_of_running_decodes() -> None:
    """An idle decode pod and idle prefill pods: the transfer and the extra step make the remote
    path slower for the request itself; with running decodes to stall, it wins."""
    router, pool, _ = make("cost")
    link = Link(131_072, 50e9)
    cyc, _, _ = router.cycle(req(LONG), list(pool))
    d, p = pool.get(D1), pool.get(P1)
    assert d is not None and p is not None
    assert not CostDecider().decide(cyc, d, p, link).disaggregate, "nobody to stall: TTFT alone, local"
    d.metrics = EndpointMetrics(running=20)
    assert CostDecider().decide(cyc, d, p, link).disaggregate
    slow = Link(131_072, 1e6)  # 1 MB/s: the transfer dominates
    assert not CostDecider().decide(cyc, d, p, slow).disaggregate


def test_cost_decider_charges_the_stall_once_per_running_decode() -> None:
    """The local path costs the request's TTFT on D plus ``running(D) × own(D)`` request-seconds:
    each of D's running requests is delayed by the prefill's own time. With 8 running on D and
    the prefill pods' queue worth about 3 × own(D), the remote path wins; the old rule, which
    charged ``own(D)`` once whatever D's batch (``itl_weight`` 1), kept it local."""
    router, pool, _ = make("cost")
    link = Link(131_072, 50e9)
    cyc, _, _ = router.cycle(req(LONG), list(pool))
    d, p = pool.get(D1), pool.get(P1)
    assert d is not None and p is not None
    d.metrics = EndpointMetrics(running=8)
    dm, pm = d.model, p.model
    uncached = cyc.prompt_tokens - cyc.cached_tokens(d.key)
    own = uncached / dm.prefill_rate
    # P's queue: waiting requests at the model's tokens per request, about 3 × own(D) of prefill.
    waiting = round(3 * uncached / pm.uncached_per_request)
    p.metrics = EndpointMetrics(waiting=waiting)
    v = CostDecider().decide(cyc, d, p, link)
    d_queued, d_running = queued_and_running(d)
    assert d_running == 8
    ttft_d = (d_queued + uncached) / dm.prefill_rate + dm.step_s(d_running)
    assert v.local_s == pytest.approx(ttft_d + 8 * own), "TTFT plus running × own, in seconds"
    assert ttft_d + own < v.remote_s < v.local_s, "charged once (the old rule) it stays local"
    assert v.disaggregate
    d.metrics = EndpointMetrics(running=1)
    assert not CostDecider().decide(cyc, d, p, link).disaggregate, "one decode to stall: local"


def test_token_threshold_decider_counts_uncached_tokens_on_the_decode_pod() -> None:
    router, pool, _ = make("token-threshold", threshold_tokens=500)
    assert router.route(req("short prompt")).prefill is None
    d0 = router.route(req(LONG))
    assert d0.prefill is not None
    router.finish(router.start(d0))
    cyc, _, _ = router.cycle(req(LONG + " again"), list(pool))
    p = pool.get(P1)
    assert p is not None
    assert not TokenThresholdDecider(500).decide(cyc, d0.primary, p, Link()).disaggregate


def test_queued_and_running_agree_with_the_cost_scorer() -> None:
    router, pool, _ = make("never")
    for i in range(7):
        router.start(router.route(req(f"{i} {LONG}")))
    cyc, _, _ = router.cycle(req(LONG), list(pool))
    for s in pool:
        s.metrics = EndpointMetrics(running=3, waiting=5)
        queued, running = queued_and_running(s)
        uncached = cyc.prompt_tokens - cyc.cached_tokens(s.key)
        want = (queued + uncached) / s.model.prefill_rate + s.model.step_s(running)
        assert CostScorer().estimate(cyc, s) == pytest.approx(want)


# ---- accounting on both pods ---------------------------------------------------------------------


def test_prefill_leg_counts_until_its_predicted_end_then_is_finished() -> None:
    router, pool, clock = make("always")
    d = router.route(req(LONG))
    ticket = router.start(d)
    assert d.prefill is not None and ticket.leg is not None
    p, dec = d.prefill, d.primary
    assert ticket.uncached_tokens == 0 and dec.load.pending_prefill_tokens == 0, (
        "the decode pod computes none"
    )
    assert (
        p.load.in_flight_requests == 1 and p.load.pending_prefill_tokens == ticket.leg.uncached_tokens > 1000
    )
    assert router.index.match(p.key, d.hashes) == len(d.hashes) == router.index.match(dec.key, d.hashes)
    clock.t = ticket.leg.due + 0.001
    router.route(req("anything"))  # expire runs at the next pick
    assert (p.load.in_flight_requests, p.load.pending_prefill_tokens) == (0, 0)
    assert dec.load.in_flight_requests == 1, "the request itself is still decoding"
    router.finish(ticket)
    assert all(s.load.in_flight_requests == 0 for s in pool)


def test_a_scrape_that_shows_the_leg_done_finishes_it_early_and_the_end_finishes_it_anyway() -> None:
    router, pool, clock = make("always")
    d = router.route(req(LONG))
    ticket = router.start(d)
    assert d.prefill is not None and ticket.leg is not None
    p = d.prefill
    clock.t += 0.2
    p.metrics = EndpointMetrics(waiting=0, running=0, request_success_total=1, updated_at=clock.t)
    router.on_scrape(p)
    assert ticket.leg.done and p.load.in_flight_requests == 0
    d2 = router.route(req("another " + LONG))
    t2 = router.start(d2)
    assert t2.leg is not None and not t2.leg.done
    router.finish(t2)  # an error before the leg's predicted end: both end
    assert t2.leg.done and all(s.load.in_flight_requests == 0 for s in pool if s is not d.primary)
    router.finish(ticket)
    assert all(s.load.in_flight_requests == 0 and s.load.pending_requests == 0 for s in pool)


def test_the_cost_scorer_spreads_prefills_over_prefill_pods_by_their_charged_legs() -> None:
    router, _, _ = make("always")
    picks = [router.start(router.route(req(f"{i} " + LONG))) for i in range(10)]
    legs = [t.leg for t in picks]
    assert all(leg is not None for leg in legs)
    per_pod = {k: sum(1 for leg in legs if leg is not None and leg.state.key == k) for k in (P1, P2)}
    assert per_pod[P1] >= 3 and per_pod[P2] >= 3, per_pod


# ---- the wire protocol -------------------------------------------------------------------------


def _headers(**extra: str) -> pb.HttpHeaders:
    hs = [
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]
    hs += [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in extra.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))


def _exchange(decider: str, mode: int) -> Exchange:
    router, _, _ = make(decider)
    return Exchange(director(router), 1 << 20, mode, mode)


def _answer(ex: Exchange, mode: int, prompt: str, **hdrs: str) -> pb.ProcessingResponse:
    out = ex.on_request_headers(_headers(**hdrs), None)
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    out += list(ex.on_request_body(pb.HttpBody(body=body, end_of_stream=True)))
    kind = "request_headers" if mode == FULL_DUPLEX else "request_body"
    return next(o for o in out if o.WhichOneof("response") == kind)


@pytest.mark.parametrize("mode", [FULL_DUPLEX, BUFFERED])
def test_disaggregated_pick_sets_the_prefiller_header_and_the_decode_pod_as_destination(mode: int) -> None:
    ex = _exchange("always", mode)
    resp = _answer(ex, mode, LONG)
    common = getattr(resp, resp.WhichOneof("response")).response
    set_h = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    lb = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST_HEADER].string_value
    assert set_h[DEST_HEADER] == lb in (D1, D2), "the destination is the decode pod, in header and metadata"
    assert set_h[PREFILLER_HEADER] in (P1, P2)
    assert ex.pick is not None and ex.pick.prefill == set_h[PREFILLER_HEADER]
    ex.close()


@pytest.mark.parametrize("mode", [FULL_DUPLEX, BUFFERED])
def test_a_client_sent_prefiller_header_is_removed_when_not_disaggregating(mode: int) -> None:
    ex = _exchange("never", mode)
    resp = _answer(ex, mode, LONG, **{PREFILLER_HEADER: "169.254.169.254:80"})
    common = getattr(resp, resp.WhichOneof("response")).response
    assert PREFILLER_HEADER not in {h.header.key for h in common.header_mutation.set_headers}
    assert list(common.header_mutation.remove_headers) == [PREFILLER_HEADER]
    ex.close()
    ex = _exchange("always", mode)
    resp = _answer(ex, mode, LONG, **{PREFILLER_HEADER: "169.254.169.254:80"})
    common = getattr(resp, resp.WhichOneof("response")).response
    set_h = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert set_h[PREFILLER_HEADER] in (P1, P2), "ours replaces the client's"
    ex.close()


def test_pd_off_sets_no_prefiller_header() -> None:
    pool = Pool()
    pool.set_endpoints(parse_list(f"{D1}=decode,{P1}=prefill"))
    router = Router(dataclasses.replace(RouterConfig()), pool)
    ex = Exchange(director(router), 1 << 20, FULL_DUPLEX, FULL_DUPLEX)
    resp = _answer(ex, FULL_DUPLEX, LONG)
    keys = {h.header.key for h in resp.request_headers.response.header_mutation.set_headers}
    assert PREFILLER_HEADER not in keys
    ex.close()


def test_explain_shows_the_pd_verdict() -> None:
    router, pool, _ = make("cost")
    busy_decode(pool)
    doc = router.explain(req(LONG))
    pd = doc["pd"]
    assert isinstance(pd, dict) and pd["prefill"] in (P1, P2) and pd["decider"] == "cost"
    assert pd["remote_ttft_s"] < pd["local_ttft_s"]
    assert all(s.load.in_flight_requests == 0 for s in pool), "explain commits nothing"
