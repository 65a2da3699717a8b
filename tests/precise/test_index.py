"""The precise index and the KV-event decoder, without sockets: keys, events, bounds, lookups."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core.config import PrefixConfig, RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.precise import PreciseIndex, State, Sync, chain_keys, continue_keys, request_keys
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.feeds import events as events_mod
from picker.feeds.events import BadEvent, Cleared, Removed, Stored, apply, decode_batch
from replica.sim import kv_events as sim_events
from replica.sim.blocks import Cleared as SimCleared
from replica.sim.blocks import Removed as SimRemoved
from replica.sim.blocks import Stored as SimStored
from replica.sim.blocks import chain_hashes

pytestmark = pytest.mark.precise
BS = 16


def payload(*events: object) -> bytes:
    body = [sim_events.encode_event(e, BS, {"ad": 1}) for e in events]  # type: ignore[arg-type]
    out = msgpack.packb([1.0, body], use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def store(idx: PreciseIndex, key: str, tokens: list[int], lora: str = "", salt: str = "") -> list[int]:
    """Store ``tokens``' full blocks on ``key`` as one engine event would; returns engine hashes."""
    hashes = chain_hashes(tokens, BS, lora, salt)
    n = len(hashes) * BS
    apply(idx, key, decode_batch(payload(SimStored(hashes, None, tokens[:n], lora, salt))))
    return hashes


def test_request_keys_equal_event_keys_with_lora_and_salt() -> None:
    """A request's keys (its LoRA and salt folded as vLLM folds them) equal the keys recomputed
    from the events the engine sends for it, split over several events, whatever the engine hash."""
    toks = list(range(100, 100 + 5 * BS + 3))
    for lora, salt in [("", ""), ("ad", ""), ("", "s"), ("ad", "s")]:
        idx = PreciseIndex()
        hashes = chain_hashes(toks, BS, lora, salt)
        first = SimStored(hashes[:2], None, toks[: 2 * BS], lora, salt)
        rest = SimStored(hashes[2:], hashes[1], toks[2 * BS : 5 * BS], lora, "")
        apply(idx, "e", decode_batch(payload(first)))
        apply(idx, "e", decode_batch(payload(rest)))
        want = request_keys(toks, BS, lora, salt)
        assert idx.holds("e") == set(want) and len(want) == 5
        assert idx.match_many(["e"], want, 0.0) == {"e": 5}
    assert len({tuple(request_keys(toks, BS, lo, sa)) for lo in ("", "ad") for sa in ("", "s")}) == 4


def test_keys_chain_and_partial_blocks() -> None:
    toks = list(range(40))
    assert len(chain_keys(toks, BS)) == 2, "the trailing partial block is not cached, so not keyed"
    other = [999, *toks[1:]]
    a, b = chain_keys(toks, BS), chain_keys(other, BS)
    assert a[0] != b[0] and a[1] != b[1], "a block's key depends on every token before its end"
    assert chain_keys([*toks[:16], 999, *toks[17:]], BS)[0] == a[0], "and on none after it"
    assert chain_keys(toks[16:32], BS, parent=a[0]) == a[1:], "continuation from the parent's key"


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    bs=st.integers(1, 40),
    at=st.integers(0, 10),
    lora=st.sampled_from(["", "ad"]),
    salt=st.sampled_from(["", "s"]),
)
def test_continued_keys_equal_the_whole_computation(
    tokens: list[int], bs: int, at: int, lora: str, salt: str
) -> None:
    """A held prefix's keys, continued over the tokens after them (the tokenization cache's
    reuse), equal the keys of all the tokens computed at once."""
    whole = request_keys(tokens, bs, lora, salt)
    known = whole[: min(at, len(whole))]
    rest = tokens[len(known) * bs :]
    assert [*known, *continue_keys(known, rest, bs, lora, salt)] == whole


def test_removed_clear_duplicates_and_unknown_parent() -> None:
    idx = PreciseIndex()
    t = list(range(3 * BS))
    hashes = store(idx, "e", t)
    keys = request_keys(t, BS)
    store(idx, "e", t)  # the same hashes cached twice (two blocks): two removes needed
    apply(idx, "e", [Removed([hashes[2]])])
    assert idx.match_many(["e"], keys, 0) == {"e": 3}, "one copy of block 2 is still cached"
    apply(idx, "e", [Removed([hashes[2], 12345])])  # unknown hashes are ignored
    assert idx.match_many(["e"], keys, 0) == {"e": 2}
    skipped = apply(idx, "e", [Stored([7], 424242, list(range(BS)), BS, None)])
    assert skipped == 1 and idx.size("e") == 2, "a child of an unknown parent cannot be keyed"
    apply(idx, "e", [Cleared()])
    assert idx.size("e") == 0 and idx.match_many(["e"], keys, 0) == {"e": 0}
    idx.check()


def test_two_engine_hashes_for_one_key_keep_the_key_until_both_go() -> None:
    idx = PreciseIndex()
    toks = list(range(BS))
    apply(idx, "e", [Stored([1], None, toks, BS, None), Stored([2], None, toks, BS, None)])
    key = request_keys(toks, BS)
    apply(idx, "e", [Removed([1])])
    assert idx.match_many(["e"], key, 0) == {"e": 1}
    idx.check()
    apply(idx, "e", [Removed([2])])
    assert idx.match_many(["e"], key, 0) == {"e": 0}
    idx.check()


def test_overflow_drops_the_endpoint_and_memory_stays_bounded() -> None:
    idx = PreciseIndex(max_blocks=8)
    store(idx, "a", list(range(4 * BS)))
    store(idx, "b", list(range(4 * BS)))
    store(idx, "a", list(range(1000, 1000 + 5 * BS)))  # 9 > 8: we missed removals
    assert idx.size("a") == 0 and idx.dropped == {"a": 1} and idx.size("b") == 4
    idx.check()


def test_remove_endpoint_frees_its_slot_for_reuse() -> None:
    idx = PreciseIndex()
    t = list(range(2 * BS))
    store(idx, "a", t)
    idx.speculate("a", request_keys(list(range(500, 500 + BS)), BS), 0.0)
    idx.remove("a")
    store(idx, "b", list(range(900, 900 + BS)))
    assert idx.match_many(["a", "b"], request_keys(t, BS), 0.0) == {"a": 0, "b": 0}
    assert idx.slot("b") == 0, "b took a's freed slot (bitmasks stay narrow)"
    idx.check()


def test_speculative_entries_expire_and_refresh() -> None:
    idx = PreciseIndex(spec_ttl_s=2.0)
    keys = request_keys(list(range(3 * BS)), BS)
    idx.speculate("a", keys, now=10.0)
    assert idx.match_many(["a", "b"], keys, 11.0) == {"a": 3, "b": 0}
    idx.speculate("a", keys[:1], now=11.5)  # refreshes block 0 only
    assert idx.match_many(["a"], keys, 12.5) == {"a": 1}, "blocks 1-2 expired at 12.0, block 0 lives"
    assert idx.match_many(["a"], keys, 13.6) == {"a": 0}
    idx.check()


def test_a_restart_forgets_speculative_entries_and_a_clear_keeps_them() -> None:
    """A restarted engine lost the requests picked for it (forget); a cleared cache or a gap does
    not lose the requests in flight, which will store their blocks again (clear)."""
    idx = PreciseIndex(spec_ttl_s=2.0)
    keys = request_keys(list(range(3 * BS)), BS)
    for key in ("a", "b"):
        idx.speculate(key, keys, now=10.0)
    idx.clear("a")
    assert idx.match_many(["a"], keys, 10.5) == {"a": 3}
    idx.forget("a")
    assert idx.match_many(["a", "b"], keys, 10.5) == {"a": 0, "b": 3}
    idx.check()


def test_speculative_entries_are_bounded() -> None:
    idx = PreciseIndex(max_speculative=10)
    for i in range(20):
        idx.speculate("a", request_keys(list(range(i * 100, i * 100 + 4 * BS)), BS), now=0.0)
    idx.check()
    assert sum(len(u) for u in idx._spec_until.values()) <= 10


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_speculative_entries_live_until_their_latest_expiry(data: st.DataObject) -> None:
    """Whatever the order of picks (keys repeated, refreshed, overlapping, on several endpoints),
    a speculative entry is held exactly while the latest pick that sent it is younger than the
    TTL: a model of (endpoint, key) → latest expiry agrees with every look-up."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    ttl = data.draw(st.sampled_from([1, 2.0, 0.5]))
    idx = PreciseIndex(spec_ttl_s=ttl)
    chains = [request_keys([rng.randrange(9) for _ in range(8 * BS)], BS) for _ in range(3)]
    latest: dict[tuple[str, int], float] = {}
    now = 0.0
    for _ in range(data.draw(st.integers(1, 40))):
        now += data.draw(st.sampled_from([0, 0.25, 0.5, 1, 1.5]))
        e = rng.choice(["a", "b", "c"])
        chain = rng.choice(chains)
        keys = (
            chain[: rng.randrange(1, 9)] if rng.random() < 0.7 else rng.choices(chain, k=rng.randrange(1, 12))
        )
        idx.speculate(e, keys, now)
        for k in keys:
            latest[e, k] = now + ttl
        probe = now + data.draw(st.sampled_from([0, 0.3, 1, 2.5]))
        chain = rng.choice(chains)
        got = idx.match_many(["a", "b", "c"], chain, probe)
        for x in "abc":
            n = 0
            while n < len(chain) and latest.get((x, chain[n]), -1.0) > probe:
                n += 1
            assert got[x] == n, (x, got, probe)
        now = probe
        idx.check()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_match_many_over_long_prompts_held_in_runs(data: st.DataObject) -> None:
    """Long prompts whose blocks each endpoint holds in runs (by its events, speculatively, both,
    or neither; many short runs too): the look-up, walking all endpoints at once and then each
    of the few left alone, equals a naive walk per endpoint."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    idx = PreciseIndex()
    n_eps = data.draw(st.sampled_from([1, 3, 5, 12]))
    eps = [f"e{i}" for i in range(n_eps)]
    toks = [rng.randrange(50) for _ in range(60 * BS)]
    keys = request_keys(toks, BS)
    for e in eps:
        run = data.draw(st.sampled_from([1, 2, 7, 30]))
        ways = rng.choices(["events", "spec", "both", "none"], [4, 4, 2, 1], k=len(keys) // run + 1)
        way = [ways[i // run] for i in range(len(keys))]
        if rng.random() < 0.2:
            way = ["both"] * len(keys)  # held whole
        hashes = store(idx, e, toks)
        apply(idx, e, [Removed([h for h, w in zip(hashes, way, strict=True) if w in ("spec", "none")])])
        idx.speculate(e, [k for k, w in zip(keys, way, strict=True) if w in ("spec", "both")], 0.0)
    q = keys[: rng.randrange(len(keys) + 1)]
    assert_matches_a_naive_walk(idx, eps, q)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_match_many_equals_a_walk_per_endpoint(data: st.DataObject) -> None:
    """The one-pass bitmask walk gives every endpoint the same match length as a naive walk
    over its confirmed and speculative keys."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    idx = PreciseIndex()
    eps = [f"e{i}" for i in range(data.draw(st.integers(1, 70)))]
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 6) * BS)] for _ in range(6)]
    for e in eps:
        for p in rng.sample(prompts, rng.randrange(0, 4)):
            hashes = store(idx, e, p)
            if rng.random() < 0.3:
                apply(idx, e, [Removed([rng.choice(hashes)])])
        if rng.random() < 0.3:  # a pick just sent there (speculative), maybe deeper than held
            idx.speculate(e, request_keys(rng.choice(prompts), BS), 0.0)
    q = rng.choice(prompts) + [1] * BS
    keys = request_keys(q, BS)
    assert_matches_a_naive_walk(idx, eps, keys)


def test_decoder_reads_vllm_forms_and_skips_other_tiers() -> None:
    got = decode_batch(
        payload(SimStored([5, 6], None, list(range(2 * BS)), "ad", "s"), SimRemoved(5), SimCleared())
    )
    assert got == [
        Stored([5, 6], None, list(range(2 * BS)), BS, [["ad", "s"], ["ad"]]),
        Removed([5]),
        Cleared(),
    ]
    cpu = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [0] * BS,
        "block_size": BS,
        "lora_id": None,
        "medium": "CPU",
    }
    array_form = ["BlockRemoved", [9], "GPU"]
    raw = msgpack.packb([1.0, [cpu, array_form], 0])
    assert decode_batch(raw) == [Removed([9])], "CPU-tier stores skipped; array-like structs read"


def test_consecutive_removals_become_one_event_and_apply_the_same() -> None:
    """vLLM sends one BlockRemoved per evicted block: a run of them decodes to one Removed (other
    tiers' events inside the run do not break it; a store or a clear does), and the index ends
    the same as applying them one by one."""

    def removed(h: int, medium: str = "GPU") -> dict[str, object]:
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0}

    toks = list(range(4 * BS))
    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": toks[: 2 * BS], "block_size": BS, "medium": "GPU"}  # fmt: skip
    events = [removed(1), ["BlockRemoved", [2], "GPU"], removed(3, "CPU"), removed(4), stored,
              removed(11), {"type": "AllBlocksCleared"}, removed(5)]  # fmt: skip
    got = decode_batch(msgpack.packb([1.0, events]))
    vllm_form = [e for e in events if isinstance(e, dict)]
    assert events_mod._decode_strict(msgpack.packb([1.0, vllm_form, None])) is not None, "the fast reading"
    assert events_mod._decode_strict(msgpack.packb([1.0, events])) is None, "array-like: the lenient one"
    assert got == [
        Removed([1, 2, 4]),
        Stored([11, 12], None, toks[: 2 * BS], BS, None),
        Removed([11]),
        Cleared(),
        Removed([5]),
    ]
    one_by_one, batched = PreciseIndex(), PreciseIndex()
    hashes = store(one_by_one, "e", toks)
    store(batched, "e", toks)
    for h in hashes[1:3]:
        apply(one_by_one, "e", decode_batch(msgpack.packb([1.0, [removed(h)]])))
    apply(batched, "e", decode_batch(msgpack.packb([1.0, [removed(h) for h in hashes[1:3]]])))
    assert batched.holds("e") == one_by_one.holds("e") and len(batched.holds("e")) == 2
    batched.check()


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=4), st.text(max_size=4)
)


@st.composite
def _wire_event(draw: st.DrawFn) -> object:
    """vLLM-shaped events, with now and then a field of another type, missing or extra."""
    n = draw(st.integers(0, 3))
    bs = draw(st.sampled_from([1, 2, 16]))
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    hashes = draw(
        st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=4)), min_size=n, max_size=n)
    )
    ev: dict[str, object] = {"type": tag}
    if tag == "BlockStored":
        ev |= {"block_hashes": hashes, "parent_block_hash": draw(st.one_of(st.none(), st.integers(0, 99))),
               "token_ids": draw(st.lists(st.integers(0, 70000), min_size=n * bs, max_size=n * bs + 1)),
               "block_size": bs, "lora_id": None, "lora_name": None,
               "extra_keys": draw(st.one_of(st.none(), st.just([["ad"]] * n)))}  # fmt: skip
    elif tag == "BlockRemoved":
        ev["block_hashes"] = hashes
    if tag != "AllBlocksCleared":
        ev["medium"] = draw(st.sampled_from(["GPU", "CPU", None]))
        ev["group_idx"] = draw(st.sampled_from([0, 1, None]))
    if draw(st.integers(0, 9)) == 0:  # now and then a field of another type, or one more or less
        key = draw(st.sampled_from([*ev, "extra"]))
        if draw(st.booleans()) and key in ev:
            del ev[key]
        else:
            ev[key] = draw(_VALUES)
    return (
        draw(st.one_of(st.just(ev), st.just([tag, *list(ev.values())[1:]])))
        if draw(st.integers(0, 9)) == 0
        else ev
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(_wire_event(), max_size=8))
def test_the_struct_decoder_reads_as_the_lenient_one(events: list[object]) -> None:
    """A batch read by msgspec's struct decoder (vLLM's exact shape) decodes to what the lenient
    reading gives, or raises the same way; any other batch is left to the lenient reading."""
    payload = msgpack.packb([1.0, events])
    try:
        want: object = events_mod._decode_lenient(payload)
    except BadEvent:
        want = BadEvent
    try:
        got: object = events_mod._decode_strict(payload)
    except BadEvent:
        got = BadEvent
    assert got is None or got == want


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 16}]]
        ),
        msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}, {"type": "BlockRemoved"}]]),
        msgpack.packb([1.0, [{"type": 7}]]),
        msgpack.packb([1.0, [42]]),
        msgpack.packb([1.0, [{"no": "type"}]]),
    ],
)
def test_decoder_rejects_bad_batches(raw: bytes) -> None:
    with pytest.raises(BadEvent):
        decode_batch(raw)


def test_token_ids_out_of_range_are_a_bad_event() -> None:
    idx = PreciseIndex()
    with pytest.raises(BadEvent):
        apply(idx, "e", [Stored([1], None, [-1] * BS, BS, None)])


@pytest.mark.parametrize(
    ("mode", "state", "precise"),
    [
        ("auto", State.WAITING, False),
        ("auto", State.SYNCED, True),
        ("auto", State.REFILL, False),
        ("precise", State.WAITING, True),
        ("precise", State.SYNCED, True),
        ("precise", State.REFILL, False),
    ],
)
def test_which_endpoints_are_routed_precisely(mode: str, state: State, precise: bool) -> None:
    """``auto``: only endpoints whose events were seen in order; ``precise``: also those that have
    published nothing yet (an idle replica); never one re-syncing after a gap (approximate)."""
    pool = Pool()
    pool.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
    router = Router(RouterConfig(prefix=PrefixConfig(mode=mode, block_size=BS)), pool)
    router.syncs["10.0.0.1:8000"] = Sync(state)
    assert router.is_precise("10.0.0.1:8000") is precise
    assert not router.is_precise("10.0.0.2:8000"), "no subscriber: approximate"
    toks = list(range(4 * BS))
    d = router.route(InferenceRequest(model="m", routing_text="t " * 64, prompt_token_ids=toks))
    assert (d.keys is not None) is precise
    off = Router(RouterConfig(), pool)
    assert off.precise is None and not off.is_precise("10.0.0.1:8000")


def assert_matches_a_naive_walk(idx: PreciseIndex, eps: list[str], keys: list[int]) -> None:
    """``match_many`` gives every endpoint (and an unknown one, 0) the length of a naive walk over
    its confirmed and speculative keys; the index's invariants hold."""
    got = idx.match_many([*eps, "unknown"], keys, 0.0)
    assert got["unknown"] == 0
    for e in eps:
        held, n = idx.holds(e) | set(idx._spec_until.get(idx._slots.get(e, -1), {})), 0
        while n < len(keys) and keys[n] in held:
            n += 1
        assert got[e] == n, e
    idx.check()
