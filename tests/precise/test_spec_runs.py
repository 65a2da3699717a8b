"""The speculative entries kept as runs (:class:`picker.core.prefix.precise.Run`) equal the
per-key computation they replace: a model that keeps one expiry per (endpoint, key), queues each
speculation's keys and expires them by the same rules (latest expiry wins; a queued speculation
drops, when it expires or the bound evicts it, those of its keys not re-timed past it), under
picks that repeat, extend, split and interleave held prefixes, with repeated keys, times that go
backwards (the bench re-times a held prompt an hour ahead), the bound on entries, restarts and
endpoints leaving. After every step the index's speculative keys, their count and every
endpoint's match equal the model's."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core.prefix.precise import PreciseIndex, request_keys

BS = 4
EPS = ("a", "b", "c")


class Model:
    """The per-key speculative entries (the index before runs), slot by slot."""

    def __init__(self, ttl: float, bound: int) -> None:
        self.ttl, self.bound = ttl, bound
        self.until: dict[int, dict[int, float]] = {}
        self.queue: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self.count = 0

    def speculate(self, s: int, keys: list[int], now: float) -> None:
        if not keys:
            return
        self.expire(now)
        until = self.until.setdefault(s, {})
        n0, exp = len(until), now + self.ttl
        for k in keys:
            until[k] = exp
        self.count += len(until) - n0
        self.queue.append((exp, s, tuple(keys)))
        while self.count > self.bound and self.queue:
            self.expire_one()

    def expire(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            self.expire_one()

    def expire_one(self) -> None:
        exp, s, keys = self.queue.popleft()
        until = self.until.get(s)
        if until is None:
            return
        n0 = len(until)
        for k in keys:
            if until.get(k, exp + 1) <= exp:
                del until[k]
        self.count -= n0 - len(until)

    def drop(self, s: int) -> None:
        self.count -= len(self.until.get(s, {}))
        self.until[s] = {}

    def depth(self, s: int, keys: list[int]) -> int:
        until, n = self.until.get(s, {}), 0
        while n < len(keys) and keys[n] in until:
            n += 1
        return n


def prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    """Keys of prompts sharing prefixes (a document and its questions, a growing conversation),
    with a small vocabulary so that chains repeat keys now and then."""
    doc = [rng.randrange(vocab) for _ in range(rng.randrange(4, 40) * BS)]
    out = [doc]
    for _ in range(6):
        base = rng.choice(out)
        cut = rng.randrange(len(base) + 1) if rng.random() < 0.5 else len(base)
        out.append(base[:cut] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 8) * BS)])
    return [request_keys(p, BS) for p in out]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_runs_equal_the_per_key_entries(data: st.DataObject) -> None:
    rng = random.Random(data.draw(st.integers(0, 10**9)))
    ttl = data.draw(st.sampled_from([1.0, 2.0, 5.0]))
    bound = data.draw(st.sampled_from([10**6, 60, 25]))
    idx, model = PreciseIndex(spec_ttl_s=ttl, max_speculative=bound), Model(ttl, bound)
    chains = prompts(rng, data.draw(st.sampled_from([3, 50, 1000])))
    now = 0.0
    for _ in range(data.draw(st.integers(1, 60))):
        op = rng.choices(["spec", "spec_odd", "match", "forget", "remove"], [8, 2, 4, 1, 1])[0]
        now += rng.choice([0.0, 0.0, 0.3, 1.0, 2.5])
        e = rng.choice(EPS)
        keys = rng.choice(chains)
        if op == "spec":
            keys = keys[: rng.randrange(1, len(keys) + 1)] if keys and rng.random() < 0.3 else keys
            at = now + 3600 if rng.random() < 0.1 else now  # a time ahead (the bench's held prompt)
            s = idx.slot(e)
            model.until.setdefault(s, {})
            idx.speculate(e, keys, at)
            model.speculate(s, keys, at)
        elif op == "spec_odd":  # repeated and out-of-order keys
            odd = rng.choices(keys, k=rng.randrange(1, 12)) if keys else [1]
            s = idx.slot(e)
            idx.speculate(e, odd, now)
            model.speculate(s, odd, now)
        elif op == "forget" and e in idx._slots:
            s = idx._slots[e]
            idx.forget(e)
            model.drop(s)
        elif op == "remove" and e in idx._slots:
            s = idx._slots[e]
            idx.remove(e)
            model.drop(s)
            del model.until[s]
        else:
            got = idx.match_many(EPS, keys, now)
            model.expire(now)
            for x in EPS:
                want = model.depth(idx._slots[x], keys) if x in idx._slots else 0
                assert got[x] == want, (op, x, got, want)
        idx.check()
        for s, until in model.until.items():
            assert set(idx._spec_until.get(s, {})) == set(until), f"slot {s}: the speculative keys differ"
        assert idx._spec_count == model.count


def test_a_conversation_retimes_its_held_prefix_as_one_run() -> None:
    """The next turn repeats the held prefix: one run carries it (re-timed in one step), and
    the turn's new keys join the index apart; a look-up steps over the runs."""
    idx = PreciseIndex(spec_ttl_s=10.0)
    first = request_keys(list(range(64 * BS)), BS)
    second = request_keys(list(range(64 * BS)) + [7] * (8 * BS), BS)
    idx.speculate("a", first, 0.0)
    idx.speculate("a", second, 5.0)
    until = idx._spec_until[idx._slots["a"]]
    assert len({id(r) for r in until.values()}) == 2, "the prefix's run and the turn's"
    assert {r.exp for r in until.values()} == {15.0}
    assert idx.match_many(["a"], second, 14.0) == {"a": len(second)}
    assert idx.match_many(["a"], second, 15.0) == {"a": 0}
    idx.check()
