"""PrefixAwareScheduler on vLLM's real V1 Scheduler (no model): all options off equals vLLM,
and page-aligned prefill keeps every non-final chunk a whole number of blocks."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest

from tests.vllm.harness import BLOCK, finish_step, make_request, make_scheduler

pytestmark = pytest.mark.vllm


def _stream(seed: int, n: int = 24) -> list[tuple[int, str, list[int], int]]:
    """(step to add at, id, prompt, max_tokens): prompts of random length, some sharing prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 2000) for _ in range(rng.randrange(16, 200))] for _ in range(3)]
    out = []
    for i in range(n):
        tail = [rng.randrange(2, 2000) for _ in range(rng.randrange(1, 300))]
        prompt = [*rng.choice(prefixes), *tail] if rng.random() < 0.6 else tail
        out.append((rng.randrange(0, 20), f"r{i}", prompt, rng.randrange(1, 6)))
    return out


def run_stream(
    sched: Any, stream: list[tuple[int, str, list[int], int]], steps: int = 400
) -> list[dict[str, int]]:
    """Drive the stream to completion; returns the scheduled tokens of each step."""
    trace: list[dict[str, int]] = []
    for step in range(steps):
        for at, rid, prompt, max_tokens in stream:
            if at == step:
                sched.add_request(make_request(rid, prompt, max_tokens, arrival=float(at)))
        if step > max(s[0] for s in stream) and not sched.has_requests():
            return trace
        out = sched.schedule()
        trace.append(dict(out.num_scheduled_tokens))
        finish_step(sched, out)
    raise AssertionError(f"stream not finished in {steps} steps: {sched.get_request_counts()}")


@pytest.mark.parametrize("seed", [0, 1])
def test_all_options_off_equals_vllm(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from replica.vllm.scheduler import PrefixAwareScheduler

    for var in (
        "KVPICK_PAGE_ALIGNED_PREFILL",
        "KVPICK_CACHE_AWARE_ADMISSION",
        "KVPICK_DEDUPE_SHARED_PREFIXES",
    ):
        monkeypatch.delenv(var, raising=False)
    stream = _stream(seed)
    plain = run_stream(make_scheduler(tiny_model_dir, 60, 100, cls=Scheduler, max_num_seqs=4), stream)
    ours = make_scheduler(tiny_model_dir, 60, 100, cls=PrefixAwareScheduler, max_num_seqs=4)
    assert not ours.kvpick.any_on, f"options default to off: {ours.kvpick}"
    assert run_stream(ours, stream) == plain


def chunks_of(trace: list[dict[str, int]]) -> dict[str, list[int]]:
    chunks: dict[str, list[int]] = {}
    for step in trace:
        for rid, n in step.items():
            chunks.setdefault(rid, []).append(n)
    return chunks


def misaligned_prefill_chunks(
    trace: list[dict[str, int]], stream: list[tuple[int, str, list[int], int]], cached: dict[str, int]
) -> list[tuple[str, int, int]]:
    """(request, start, size) of each prefill chunk that is not final and not whole blocks."""
    prompts = {rid: len(prompt) for _, rid, prompt, _ in stream}
    bad = []
    for rid, sizes in chunks_of(trace).items():
        done = cached[rid]
        for size in sizes:
            if done + size < prompts[rid] and size % BLOCK:
                bad.append((rid, done, size))
            done += size
    return bad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_page_aligned_prefill_chunks_are_whole_blocks(tiny_model_dir: pathlib.Path, seed: int) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    stream = _stream(seed)
    results = {}
    for name, cls, kwargs in (
        ("vllm", Scheduler, {}),
        ("ours", PrefixAwareScheduler, {"options": PrefixAwareOptions(page_aligned_prefill=True)}),
    ):
        sched = make_scheduler(tiny_model_dir, 200, 100, cls=cls, max_num_seqs=4, **kwargs)
        cached: dict[str, int] = {}
        orig = sched.schedule

        def schedule(orig: Any = orig, cached: dict[str, int] = cached) -> Any:
            out = orig()
            cached.update({r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs})
            return out

        sched.schedule = schedule
        results[name] = misaligned_prefill_chunks(run_stream(sched, stream), stream, cached)
    assert results["vllm"], "the stream must make vLLM cut some chunk mid-block, or the test proves nothing"
    assert results["ours"] == [], f"non-final chunks not page aligned: {results['ours'][:5]}"


def test_async_variant_applies_the_same_hooks(tiny_model_dir: pathlib.Path) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.queue import CacheAwareQueue
    from replica.vllm.scheduler import PrefixAwareAsyncScheduler

    opts = PrefixAwareOptions(page_aligned_prefill=True, cache_aware_admission=True)
    sched = make_scheduler(tiny_model_dir, 200, 100, cls=PrefixAwareAsyncScheduler, options=opts)
    assert isinstance(sched, AsyncScheduler) and isinstance(sched.waiting, CacheAwareQueue)
    sched.add_request(make_request("a", list(range(10, 310))))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 96}, "a 100-token budget gives a 6-block chunk"
    assert sched.schedule().num_scheduled_tokens == {"a": 96}, "async: the next chunk before any output"


def test_page_alignment_never_stalls_when_a_block_exceeds_the_chunk_cap() -> None:
    from replica.vllm.scheduler import page_aligned

    assert page_aligned(0, 100, 300, 16, 512) == 96
    assert page_aligned(96, 10, 300, 16, 512) == 0, "no boundary fits: wait for a bigger budget"
    assert page_aligned(290, 10, 300, 16, 512) == 10, "the final chunk is never trimmed"
    assert page_aligned(0, 8, 300, 16, 8) == 8, "a cap below one block: alignment would stall forever"


def test_options_reach_the_scheduler_from_the_environment(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from replica.vllm.queue import CacheAwareQueue
    from replica.vllm.scheduler import PrefixAwareScheduler

    monkeypatch.setenv("KVPICK_CACHE_AWARE_ADMISSION", "1")
    monkeypatch.setenv("KVPICK_AGING_S", "0.5")
    sched = make_scheduler(tiny_model_dir, 60, 100, cls=PrefixAwareScheduler)
    assert isinstance(sched.waiting, CacheAwareQueue) and sched.waiting.aging_s == 0.5
