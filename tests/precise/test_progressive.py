"""Progressive tokenization (``HFPromptTokenizer.begin`` / ``advance``) is exact: at every step its
ids are the first ids of the whole text's tokenization, and once done they are all of them, for
random texts (words, runs of spaces and newlines, multi-byte characters, special tokens), chunk
sizes, and chat templates rendered over random conversations; with the prefix cache warm from a
text sharing any prefix, or cold."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picker.core.tokenize import load
from picker.core.tokenize.hf import HFPromptTokenizer
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
    return tokenizer_dir(tmp_path_factory.mktemp("prog"), TOOLS_TEMPLATE, vocab_size=1024, lines=600)


texts = st.lists(st.sampled_from(PIECES), min_size=100, max_size=800).map("".join)


def check(ours: HFPromptTokenizer, text: str, chunk: int, warm: str | None) -> None:
    whole = ours.tok.encode(text, add_special_tokens=False).ids
    if warm is not None:
        ours.text_ids(warm, False)  # the cache remembers a text sharing some prefix
    p = ours.begin(text, False)
    assert p.ids == whole[: len(p.ids)]
    steps = 0
    while not p.done:
        q = ours.advance(p, chunk)
        assert q.pos > p.pos and len(q.ids) >= len(p.ids)
        assert q.ids == whole[: len(q.ids)], (steps, q.pos)
        assert not q.ends or q.ends[-1] == q.pos, "the ids cover text[:pos] exactly"
        p, steps = q, steps + 1
    assert p.ids == whole


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


turns = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), texts), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=turns, chunk=st.integers(64, 4000), tools=st.booleans())
def test_progressive_over_rendered_chat_templates(
    tok_dir: pathlib.Path, conversation: list[tuple[str, str]], chunk: int, tools: bool
) -> None:
    ours = load(str(tok_dir), cache_entries=8)
    doc = {"messages": [{"role": r, "content": c} for r, c in conversation]}
    if tools:
        doc["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = ours.prompt_text(doc, "/v1/chat/completions")
    assert got is not None
    text, special = got
    assert not special
    check(ours, text, chunk, None)
    # the next turn: the cache holds this one, progressive tokenization of the longer one is exact
    doc["messages"].append({"role": "user", "content": "and then " + conversation[0][1][:300]})
    longer = ours.prompt_text(doc, "/v1/chat/completions")
    assert longer is not None
    check(ours, longer[0], chunk, text)
