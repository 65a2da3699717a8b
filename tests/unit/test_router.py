"""The router's hot path: cycle building, accounting, rate learning, index upkeep, policies."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from picker.core.accounting import Ticket
from picker.core.config import IndexConfig, RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint, EndpointMetrics, Health
from picker.core.errors import NoEndpoints, Overloaded
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.core.scheduling.cost import TIE_MARGIN, CostScorer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(n: int = 2, policy: str = "cost", **cfg_kw: object) -> tuple[Router, Pool, Clock]:
    pool = Pool()
    pool.set_endpoints([Endpoint("127.0.0.1", 8001 + i) for i in range(n)])
    clock = Clock()
    cfg = dataclasses.replace(RouterConfig(policy=policy), **cfg_kw)  # type: ignore[arg-type]
    return Router(cfg, pool, clock=clock), pool, clock


def req(text: str, **kw: object) -> InferenceRequest:
    return InferenceRequest(model="m", routing_text=text, **kw)  # type: ignore[arg-type]


def test_accounting_returns_to_zero_and_finish_is_idempotent() -> None:
    router, pool, _ = make(3)
    tickets = [router.start(router.route(req(f"prompt {i} " * 50))) for i in range(30)]
    assert sum(s.load.in_flight_requests for s in pool) == 30
    assert sum(s.load.in_flight_tokens for s in pool) == sum(t.prompt_tokens for t in tickets)
    for i, t in enumerate(tickets):
        if i % 2:
            router.first_token(t)
        router.finish(t)
        router.finish(t)  # a second end (error after end-of-stream, reset after abort) is a no-op
        router.first_token(t)  # and a late first byte changes nothing
    for s in pool:
        assert (s.load.in_flight_requests, s.load.in_flight_tokens, s.load.pending_prefill_tokens) == (
            0,
            0,
            0,
        ), s.key


def test_a_finished_ticket_queued_for_its_prefill_holds_no_request_text() -> None:
    """A long prompt's ticket stays in ``prefill_due`` until its predicted end (far off here:
    nothing scrapes), but once finished it keeps neither the cycle (the request and its routing
    text) nor the block hashes: holding them grew the heap by a whole prompt per request."""
    router, pool, _ = make(1)
    live = router.start(router.route(req("the long shared document " * 5000)))
    done = router.start(router.route(req("another long document " * 5000)))
    router.finish(done)
    [state] = list(pool)
    assert done in state.load.prefill_due, "still queued: its predicted prefill end is to come"
    assert done.cycle is None and done.hashes == ()
    assert live.cycle is not None and len(live.hashes) > 0, "a live ticket keeps them (re-credit)"
    router.finish(live)
    assert all(t.cycle is None and not t.hashes for t in state.load.prefill_due)


def test_cycle_estimates_tokens_and_cached_prefix() -> None:
    router, _, _ = make(1)
    text = "x" * 6400  # 100 blocks of 64 bytes, 1600 tokens at 4 chars/token
    d = router.route(req(text))
    assert (d.cycle.prompt_tokens, d.cycle.n_blocks, len(d.hashes)) == (1600, 100, 100)
    router.finish(router.start(d))
    d2 = router.route(req(text[:3200] + "y" * 3200))
    assert d2.cycle.matches[d.primary.key] == 50
    assert d2.cycle.cached_tokens(d.primary.key) == 800


def test_token_id_prompts_use_the_id_count() -> None:
    router, _, _ = make(1)
    ids = tuple(range(1000, 1300))
    d = router.route(req(" ".join(map(str, ids)), prompt_token_ids=ids))
    assert d.cycle.prompt_tokens == 300
    assert d.cycle.block_tokens == pytest.approx(300 / d.cycle.n_blocks)


def test_the_calibrated_model_reaches_the_cost_estimate_and_the_explain_api() -> None:
    """Scrapes (not responses) calibrate: after 130 scrape deltas each, the slow endpoint's own
    rate (1,024 tokens/s) and the fast one's (4,096) are in the TTFT estimates, and the explain
    API says where each estimate came from."""
    router, pool, _ = make(2)
    slow, fast = list(pool)
    fresh = router.explain(req("a" * 4096))["endpoints"]
    assert isinstance(fresh, dict)
    assert fresh[slow.key]["model"]["prefill_source"] == "default"
    for k in range(131):
        for state, rate in ((slow, 1024.0), (fast, 4096.0)):
            # per scrape: 2 requests, 1,024 uncached tokens, prefill seconds = tokens / rate + one step each
            secs = k * (1024 / rate + 2 * state.model.step_s(0))
            state.metrics = EndpointMetrics(
                prefill_computed_tokens_sum=1024.0 * k,
                prefill_seconds_sum=secs,
                prefill_count=2.0 * k,
                updated_at=k,
            )
            router.on_scrape(state)
    endpoints = router.explain(req("a" * 4096))["endpoints"]  # 1024 tokens, nothing cached
    assert isinstance(endpoints, dict)
    est = {k: e["ttft_estimate_s"] for k, e in endpoints.items()}
    assert est[slow.key] > 2.5 * est[fast.key]
    assert slow.model.prefill_rate == pytest.approx(1024.0, rel=0.25)
    assert fast.model.prefill_rate == pytest.approx(4096.0, rel=0.25)
    assert endpoints[slow.key]["model"]["prefill_source"] == "calibrated from 130 scrapes"
    assert endpoints[slow.key]["model"]["step_source"] == "default", "no decode seen yet"


def test_pool_removal_drops_index_entries() -> None:
    router, pool, _ = make(2, policy="round-robin")
    for i in range(4):
        router.finish(router.start(router.route(req(f"doc {i} " * 100))))
    assert router.index.size("127.0.0.1:8001") > 0 and router.index.size("127.0.0.1:8002") > 0
    pool.set_endpoints([Endpoint("127.0.0.1", 8002)])
    assert router.index.size("127.0.0.1:8001") == 0 and "127.0.0.1:8001" not in list(router.index.keys())
    assert router.index.size("127.0.0.1:8002") > 0


def test_an_unreachable_endpoint_loses_its_approximate_entries_only() -> None:
    """It may come back restarted with an empty cache: our record of its prefixes goes, the
    other endpoint's stays, and its derived capacity is kept for when it returns."""
    router, pool, _ = make(2, policy="round-robin")
    for i in range(4):
        router.finish(router.start(router.route(req(f"doc {i} " * 100))))
    down, up = sorted(pool, key=lambda s: s.key)
    down.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=1000)
    router.refresh_capacity(down)
    assert router.index.size(down.key) > 0 and router.index.size(up.key) > 0
    kept = router.index.size(up.key)
    router.on_unreachable(down)
    assert router.index.size(down.key) == 0 and router.index.size(up.key) == kept
    assert router.index._lrus[down.key].capacity == 1334  # 1000 blocks of KV * 4/3 (refresh_capacity)


def test_refresh_capacity_from_cache_config() -> None:
    router, pool, _ = make(1)
    state = next(iter(pool))
    router.refresh_capacity(state)  # nothing scraped yet: default capacity stays
    state.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=1000)
    router.refresh_capacity(state)
    # 16 tokens * 1000 blocks * 4 chars/token / 64 bytes per hash block = 1000 hash blocks of KV,
    # times segments / (segments - 1) = 4/3: the LRU always keeps at least the engine's 1000
    lru = router.index._lrus[state.key]
    assert lru.capacity == 1334
    router.index.record(state.key, list(range(5000)))  # one path, recorded deepest block first
    assert router.index.size(state.key) <= 1334
    assert router.index.match(state.key, list(range(5000))) >= 1000, "the path's head, a KV's worth, is kept"

    off, pool2, _ = make(1, index=IndexConfig(derive_capacity=False))
    s2 = next(iter(pool2))
    s2.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=1000)
    off.refresh_capacity(s2)
    assert s2.key not in list(off.index.keys()), "derive_capacity=False keeps the configured default"


def test_derived_capacity_is_clamped_to_the_configured_maximum() -> None:
    router, pool, _ = make(1, index=IndexConfig(max_derived_capacity_blocks=5000))
    state = next(iter(pool))
    state.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=10**9)  # a bogus, huge report
    router.refresh_capacity(state)
    assert router.index._lrus[state.key].capacity == 5000
    router.index.record(state.key, list(range(20_000)))
    assert router.index.size(state.key) <= 5000
    state.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=2000)  # 2000 blocks: under the cap
    router.refresh_capacity(state)
    assert router.index._lrus[state.key].capacity == 2667  # 2000 * 4/3, rounded up


def test_default_maximum_derived_capacity() -> None:
    router, pool, _ = make(1)
    state = next(iter(pool))
    state.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=10**12)
    router.refresh_capacity(state)
    assert router.index._lrus[state.key].capacity == IndexConfig().max_derived_capacity_blocks == 1_000_000
    with pytest.raises(ValueError, match="max_derived_capacity_blocks"):
        IndexConfig(max_derived_capacity_blocks=1)


def _decoding(router: Router, r: InferenceRequest) -> Ticket:
    """Send ``r`` and let its prefill finish; it stays in flight (decoding)."""
    t = router.start(router.route(r))
    router.first_token(t)
    return t


def test_hot_prefix_spills_under_cost_once_load_builds_up() -> None:
    """One hot prefix, requests held in flight (decoding): the cost policy keeps it on the endpoint
    that has it until the load guard trips (33 in flight vs 0: limit max(0 * 1.5, 0 + 32) = 32),
    then the prefix spills to the second endpoint, which caches it too and shares the load."""
    router, pool, _ = make(2, policy="cost")
    hot = "You are a helpful assistant. " * 400
    tickets = [_decoding(router, req(hot + f" question {i}")) for i in range(100)]
    targets = [t.state.key for t in tickets]
    assert len(set(targets[:33])) == 1, f"the first 33 share one endpoint: {targets[:33]}"
    assert targets[33] != targets[0], "the 34th spills"
    counts = Counter(targets)
    assert len(counts) == 2 and min(counts.values()) >= 30, f"both share the hot prefix: {counts}"
    for t in tickets:
        router.finish(t)
    assert all(s.load.in_flight_requests == 0 for s in pool)


def test_in_flight_prefill_counts_as_queued_work() -> None:
    """A hot prompt whose first prefill has not finished is not cached yet: waiting behind it costs
    about as much time as computing it elsewhere. Ranked by TTFT alone (miss_penalty 0) the two
    endpoints tie (within one engine step); with the default penalty, a second copy of the prefix
    elsewhere is charged too, so it queues behind the first on the endpoint that will hold it."""
    hot = "You are a helpful assistant. " * 400
    for penalty in (0.0, 1.0):
        router, _, _ = make(2, policy="cost")
        cost = router.profile.scorer("cost")
        assert isinstance(cost, CostScorer)
        cost.miss_penalty = penalty
        first = router.start(router.route(req(hot + "0")))
        d = router.route(req(hot + "1"))
        if penalty == 0.0:
            scores = d.result.per_scorer["cost"]
            assert min(scores.values()) >= 1.0 - 2 * TIE_MARGIN, f"a tie: {scores}"
            assert d.primary.key == first.state.key, "a tie goes to the endpoint holding the prefix"
            continue
        second = router.start(d)
        assert first.state is second.state
        assert second.matched_blocks == first.matched_blocks + len(hot) // 64


def test_hot_prefix_sticks_when_requests_complete() -> None:
    router, _, _ = make(4, policy="cost")
    hot = "shared system prompt " * 300
    keys = set()
    for i in range(50):
        d = router.route(req(hot + str(i)))
        keys.add(d.primary.key)
        router.finish(router.start(d))
    assert len(keys) == 1, f"no load builds up, so the prefix stays put: {keys}"


def test_round_robin_ignores_prefixes() -> None:
    router, _, _ = make(3, policy="round-robin")
    hot = "same prompt " * 300
    keys = []
    for _ in range(6):
        d = router.route(req(hot))
        keys.append(d.primary.key)
        router.finish(router.start(d))
    assert keys == ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"] * 2


def test_distinct_prefixes_spread_under_cost() -> None:
    router, _, _ = make(4, policy="cost")
    keys = Counter(
        router.start(router.route(req(f"{i} unique document " * 200))).state.key for i in range(40)
    )
    assert len(keys) == 4, f"cold prompts do not pile onto one endpoint: {keys}"


def test_no_endpoint_raises_503() -> None:
    router, pool, _ = make(2)
    for s in pool:
        s.health = Health.UNREACHABLE
    with pytest.raises(NoEndpoints) as info:
        router.route(req("x"))
    assert info.value.status == 503
    pool.set_endpoints([])
    with pytest.raises(NoEndpoints):
        router.route(req("x"))


def test_explain_has_no_side_effects() -> None:
    router, pool, _ = make(2)
    hot = "explain me " * 100
    router.finish(router.start(router.route(req(hot))))
    sizes = router.index.size()
    out = router.explain(req(hot, session_id="s"))
    assert out["policy"] == "cost" and out["blocks"] == 18
    endpoints = out["endpoints"]
    assert isinstance(endpoints, dict) and set(endpoints) == {s.key for s in pool}
    assert router.index.size() == sizes and all(s.load.in_flight_requests == 0 for s in pool)
    chosen = out["chosen"]
    assert isinstance(chosen, list) and endpoints[chosen[0]]["matched_blocks"] == 18


def test_recredit_moves_accounting_index_and_rate_to_the_served_endpoint() -> None:
    router, pool, clock = make(2, policy="round-robin")
    a, b = (pool.get(f"127.0.0.1:{8001 + i}") for i in range(2))
    assert a is not None and b is not None
    text = "shared document " * 400
    t = router.start(router.route(req(text), subset={a.key}))
    assert t.state is a and a.load.in_flight_requests == 1 and a.load.pending_prefill_tokens > 0
    assert router.index.size(a.key) > 0
    assert router.recredit(t, b.key)
    assert (a.load.in_flight_requests, a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (0, 0, 0)
    assert b.load.in_flight_requests == 1 and b.load.in_flight_tokens == t.prompt_tokens
    assert b.load.pending_prefill_tokens == t.uncached_tokens == t.prompt_tokens
    assert router.index.size(a.key) == 0 and router.index.size(b.key) > 0
    assert not router.recredit(t, b.key) and not router.recredit(t, "10.9.9.9:1")
    clock.t += 1.0
    router.first_token(t)
    assert b.load.pending_prefill_tokens == 0 and not t.pending, "the first byte released it on b"
    router.finish(t)
    for s in (a, b):
        assert (s.load.in_flight_requests, s.load.in_flight_tokens, s.load.pending_prefill_tokens) == (
            0,
            0,
            0,
        )
    assert not router.recredit(t, a.key)  # done: nothing moves


def test_recredit_keeps_what_the_primary_already_held() -> None:
    router, pool, _ = make(2, policy="round-robin")
    a, b = (pool.get(f"127.0.0.1:{8001 + i}") for i in range(2))
    assert a is not None and b is not None
    base = "system prompt " * 200
    router.finish(router.start(router.route(req(base), subset={a.key})))
    held = router.index.size(a.key)
    t = router.start(router.route(req(base + "and a new question " * 50), subset={a.key}))
    assert router.index.size(a.key) > held
    router.recredit(t, b.key)
    assert router.index.size(a.key) == held
    router.finish(t)


@pytest.mark.parametrize("subset", [frozenset(), frozenset({"10.0.0.1:1"})])
def test_subset_with_nothing_eligible_is_no_endpoints(subset: frozenset[str]) -> None:
    router, _, _ = make(2)
    with pytest.raises(NoEndpoints):
        router.route(req("x"), subset=subset)


def test_subset_limits_the_candidates() -> None:
    router, pool, _ = make(3, policy="round-robin")
    keys = [s.key for s in pool]
    picked = {router.route(req(f"p{i}"), subset={keys[1], keys[2]}).primary.key for i in range(12)}
    assert picked == {keys[1], keys[2]}


def test_objective_priority_from_config_decides_who_is_shed() -> None:
    router, pool, _ = make(2, objectives={"batch": -1, "chat": 5})
    for s in pool:
        s.metrics.waiting = 500  # every endpoint saturated
    with pytest.raises(Overloaded):
        router.route(req("x", objective="batch"))
    for objective in ("chat", "", "unknown"):
        d = router.route(req("x", objective=objective))
        assert d.cycle.priority == router.cfg.objectives.get(objective, 0)
    pool.get("127.0.0.1:8002").metrics.waiting = 100  # type: ignore[union-attr]
    assert router.route(req("y", objective="chat")).primary.key == "127.0.0.1:8002"
    router.objectives.put("chat", -2)  # an InferenceObjective object wins over config
    with pytest.raises(Overloaded):
        router.route(req("z", objective="chat"))
    router.objectives.remove("chat")
    assert router.route(req("z", objective="chat")).cycle.priority == 5


def test_any_ready_is_least_in_flight_within_subset() -> None:
    router, pool, _ = make(3)
    a, b, c = list(pool)
    a.load.in_flight_requests, b.load.in_flight_requests, c.load.in_flight_requests = 3, 1, 0
    assert router.any_ready() is c
    assert router.any_ready({a.key, b.key}) is b
    with pytest.raises(NoEndpoints):
        router.any_ready(set())


def test_cut_routing_text_hashes_the_same_and_estimates_the_whole_prompt() -> None:
    import orjson

    from picker.core.request import parse

    router, _, _ = make(1)
    opts = router.parse_options
    assert opts.max_text_chars == router.cfg.hashing.block_size * router.cfg.hashing.max_blocks
    body = orjson.dumps({"model": "m", "prompt": "long document " * 100_000})  # 1.4 MB
    cut, _ = parse(body, "/v1/completions", {}, opts=opts)
    whole, _ = parse(body, "/v1/completions", {})
    assert len(cut.routing_text) == opts.max_text_chars < len(whole.routing_text)
    d_cut, d_whole = router.route(cut), router.route(whole)
    assert d_cut.hashes == d_whole.hashes
    assert d_cut.cycle.prompt_tokens == d_whole.cycle.prompt_tokens == 1_400_000 // 4


def test_media_tokens_are_added_to_the_prompt_estimate() -> None:
    router, _, _ = make(1)
    plain = router.route(req("a" * 400)).cycle.prompt_tokens
    assert router.route(req("a" * 400, media_tokens=1024)).cycle.prompt_tokens == plain + 1024
