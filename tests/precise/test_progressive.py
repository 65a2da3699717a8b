"""Progressive tokenization (``HFPromptTokenizer.begin`` / ``advance``) is exact: at every step its
ids are the first ids of the whole text's tokenization, and once done they are all of them, for
random texts (words, runs of spaces and newlines, multi-byte characters, special tokens), chunk
sizes, and chat templates rendered over random conversations; with the prefix cache warm from a
text sharing any prefix, or cold. Its KV-block keys (reused from the cache, extended over new
ids) equal the keys of its ids computed at once, with or without the tokenizer's special head and
tail, for random block sizes, LoRA adapters and salts."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picker.core.prefix.precise import request_keys
from picker.core.tokenize import load
from picker.core.tokenize.hf import HFPromptTokenizer, Keying, Progress
from tests.support.parity import TOOLS_TEMPLATE
from tests.support.tokenizer import tokenizer_dir

pytestmark = pytest.mark.precise

PIECES = [
    "the",
    "cache",
    "router7",
    " ",
    "  ",
    "\n",
    "\n\n",
    "ünï",
    "✓",
    "<s>",
    "12345",
    "x",
    "\t",
    "block42 ",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tokenizer_dir(
        tmp_path_factory.mktemp("prog"),
        TOOLS_TEMPLATE,
        vocab_size=1024,
        lines=600,
        add_bos=True,
        add_eos=True,
    )


texts = st.lists(st.sampled_from(PIECES), min_size=100, max_size=800).map("".join)


keyings = st.builds(Keying, st.integers(1, 40), st.sampled_from(["", "ad"]), st.sampled_from(["", "s"]))


def check(
    ours: HFPromptTokenizer,
    text: str,
    chunk: int,
    warm: str | None,
    keying: Keying | None = None,
    special: bool = False,
    last: int = 0,
) -> None:
    whole = ours.tok.encode(text, add_special_tokens=False).ids
    if warm is not None:
        ours.text_ids(warm, special)  # the cache remembers a text sharing some prefix

    def keyed(p: Progress) -> None:
        if keying is None:
            assert p.keys == []
        else:
            want = request_keys(ours.ids_of(p), keying.block_size, keying.lora, keying.salt)
            assert p.keys == want, "the keys are those of the ids so far"

    p = ours.begin(text, special, keying, last)
    assert list(p.ids) == whole[: len(p.ids)]
    keyed(p)
    steps = 0
    while not p.done:
        q = ours.advance(p, chunk)
        assert q.pos > p.pos and len(q.ids) >= len(p.ids)
        assert list(q.ids) == whole[: len(q.ids)], (steps, q.pos)
        assert not q.ends or q.ends[-1] == q.pos, "the ids cover text[:pos] exactly"
        keyed(q)
        p, steps = q, steps + 1
    assert list(p.ids) == whole
    if special:
        assert list(ours.ids_of(p)) == ours.tok.encode(text, add_special_tokens=True).ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, chunk=st.integers(32, 2000), share=st.integers(0, 3000), tail=texts)
def test_progressive_ids_are_the_whole_tokenization_prefix(
    tok_dir: pathlib.Path, text: str, chunk: int, share: int, tail: str
) -> None:
    ours = load(str(tok_dir), cache_entries=4)
    check(ours, text, chunk, None)
    check(load(str(tok_dir), cache_entries=4), text, chunk, text[:share] + tail)
    no_cache = load(str(tok_dir), cache_entries=0)
    check(no_cache, text, chunk, None)


long_texts = (
    st.lists(st.sampled_from(PIECES), min_size=100, max_size=800)
    .map("".join)
    .map(lambda s: s * (1 + 2100 // len(s)))  # the cache keeps texts of 2 KiB or more
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
)
@given(
    text=long_texts,
    chunk=st.integers(200, 3000),
    share=st.integers(0, 6000),
    tail=long_texts,
    keying=keyings,
    special=st.booleans(),
    last=st.sampled_from([0, 300, 4000, 100_000]),
)
def test_progressive_keys_are_the_keys_of_the_ids(
    tok_dir: pathlib.Path,
    text: str,
    chunk: int,
    share: int,
    tail: str,
    keying: Keying,
    special: bool,
    last: int,
) -> None:
    """Texts the cache keeps (2 KiB or more): keys computed, reused from the cache for the same
    text, for a text that shares a prefix with it (the cache's ids and keys cut before the
    divergence), and for a text the cache holds without keys; with the rest tokenized at once
    when short (``last``: the cut's lists extended in place, the cache's left intact)."""
    ours = load(str(tok_dir), cache_entries=4)
    other = text[:share] + tail
    check(ours, text, chunk, None, keying, special, last)
    check(ours, text, chunk // 2 + 1, None, keying, special, last)  # ids and keys from the cache
    check(ours, other, chunk, None, keying, special, last)  # a sibling: the shared part's keys reused
    check(ours, text, chunk, None, keying, special, last)  # the cache's lists were not mutated
    check(ours, text, chunk, None, Keying(keying.block_size + 1), special, last)  # other keys: rehashed
    warm = load(str(tok_dir), cache_entries=4)
    check(warm, text, chunk, other, keying, special, last)  # the cache holds ids without keys
    assert ours.cache is not None and ours.cache.hits, "the cache was used"


turns = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), texts), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=turns, chunk=st.integers(64, 4000), tools=st.booleans(), keying=keyings)
def test_progressive_over_rendered_chat_templates(
    tok_dir: pathlib.Path, conversation: list[tuple[str, str]], chunk: int, tools: bool, keying: Keying
) -> None:
    ours = load(str(tok_dir), cache_entries=8)
    doc = {"messages": [{"role": r, "content": c} for r, c in conversation]}
    if tools:
        doc["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = ours.prompt_text(doc, "/v1/chat/completions")
    assert got is not None
    text, special = got
    assert not special
    check(ours, text, chunk, None, keying)
    # the next turn: the cache holds this one, progressive tokenization of the longer one is exact
    doc["messages"].append({"role": "user", "content": "and then " + conversation[0][1][:300]})
    longer = ours.prompt_text(doc, "/v1/chat/completions")
    assert longer is not None
    check(ours, longer[0], chunk, text, keying)


def test_a_cut_extended_in_place_leaves_earlier_ids_alone(tok_dir: pathlib.Path) -> None:
    """The ids are arrays shared by the cache and the requests: ``begin`` extends only its own
    fresh cut in place. An earlier request's ids and the cache's exact hit stay as they were,
    and the extended ids are the whole tokenization's."""
    ours = load(str(tok_dir))
    keying = Keying(16)
    base = " ".join(f"block{i} the cache router7" for i in range(400))
    first = ours.begin(base, False, keying, last=1 << 20)
    assert first.done
    snapshot = (first.ids.tobytes(), first.ends.tobytes(), list(first.keys))
    again = ours.begin(base, False, keying)  # an exact hit: the cache's own arrays
    longer = base + " and then a new turn" * 30
    grown = ours.begin(longer, False, keying, last=1 << 20)  # a cut of them, extended in place
    assert grown.done and list(grown.ids) == ours.tok.encode(longer, add_special_tokens=False).ids
    assert grown.keys == request_keys(grown.ids, 16)
    for p in (first, again):
        assert (p.ids.tobytes(), p.ends.tobytes(), list(p.keys)) == snapshot, (
            "an earlier request's ids changed"
        )


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
)
@given(text=st.one_of(texts, long_texts), share=st.integers(0, 6000), tail=long_texts)
def test_text_ids_with_the_special_head_and_tail_are_the_whole_tokenization(
    tok_dir: pathlib.Path, text: str, share: int, tail: str
) -> None:
    """``text_ids(text, special=True)`` is the tokenizer's own encoding with its special tokens,
    for short texts (a list) and the cache's long ones (an array joined with the head and tail),
    cold, and warm from a text sharing any prefix; the cached ids themselves are left as they were."""
    want = load(str(tok_dir), cache_entries=0).tok.encode(text, add_special_tokens=True).ids
    for warm in (None, text[:share] + tail):
        ours = load(str(tok_dir), cache_entries=4)
        if warm is not None:
            ours.text_ids(warm, True)
        assert list(ours.text_ids(text, True)) == want
        assert list(ours.text_ids(text, True)) == want, "a second call, from the cache"
        assert list(ours.text_ids(text, False)) == want[1:-1], "the head and tail: one token each"
