"""Config: YAML overlays dataclass defaults; unknown keys are errors; custom profiles route."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.core import config
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.hashing import HashConfig
from picker.core.request import InferenceRequest
from picker.core.router import Router

YAML = """
policy: prefix-only
hashing: {block_size: 32}
index: {capacity_blocks: 1000}
fallbacks: 1
lora_adapters: [adapter-a]
profiles:
  prefix-only:
    filters: [{type: ready}, {type: not-saturated, params: {max_waiting: 4}}]
    scorers: [{type: prefix, weight: 2}, {type: queue, weight: 1}]
    picker: {type: max-score, params: {seed: 1}}
"""


def test_defaults() -> None:
    cfg = config.RouterConfig()
    assert cfg.policy == "cost" and cfg.hashing == HashConfig(64, 2048)
    assert cfg.index.capacity_blocks == 31_250 and cfg.scrape.interval_s == 0.2
    assert {"cost", "round-robin", "least-loaded"} <= set(cfg.profiles)


def test_yaml_overlay_and_custom_profile(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(YAML)
    cfg = config.load_file(str(path))
    assert cfg.policy == "prefix-only" and cfg.fallbacks == 1
    assert cfg.hashing.block_size == 32 and cfg.hashing.max_blocks == 2048, "unset keys keep defaults"
    assert cfg.index.capacity_blocks == 1000 and cfg.index.segments == 4
    assert cfg.lora_adapters == frozenset({"adapter-a"})
    assert "cost" in cfg.profiles, "custom profiles add to the built-ins"

    pool = Pool()
    pool.set_endpoints([Endpoint("127.0.0.1", 8001), Endpoint("127.0.0.1", 8002)])
    router = Router(cfg, pool)
    assert router.profile.name == "prefix-only"
    req = InferenceRequest(model="m", routing_text="shared document " * 100)
    first = router.route(req)
    router.finish(router.start(first))
    for _ in range(10):
        d = router.route(req)
        assert d.primary is first.primary, "the prefix scorer keeps the prefix where it was sent"
        assert len(d.chosen) == 2, "one fallback"
        router.finish(router.start(d))


def test_overlay_on_a_base() -> None:
    base = config.load({"fallbacks": 0})
    cfg = config.load({"scrape": {"timeout_s": 3.0}}, base)
    assert cfg.fallbacks == 0 and cfg.scrape.timeout_s == 3.0 and cfg.scrape.interval_s == 0.2


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"polcy": "cost"}, r"config: unknown keys \['polcy'\]"),
        ({"hashing": {"block_sz": 8}}, r"hashing: unknown keys \['block_sz'\]"),
        ({"index": {"capacity": 8}}, r"index: unknown keys \['capacity'\]"),
        ({"scrape": {"every": 1}}, r"scrape: unknown keys \['every'\]"),
        ({"policy": "fastest"}, "unknown policy 'fastest'; known: cost"),
    ],
)
def test_bad_config_is_rejected(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config.load(raw)


def test_bad_profile_is_rejected_when_built() -> None:
    cfg = config.load({"profiles": {"p": {"scorers": [{"type": "prefix", "params": {"x": 1}}]}}})
    with pytest.raises(ValueError, match=r"scorer 'prefix': unknown params \['x'\]"):
        Router(cfg, Pool())


def test_file_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        config.load_file(str(path))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert config.load_file(str(empty)) == config.RouterConfig()


def test_objectives_take_plain_or_spec_priorities() -> None:
    cfg = config.load({"objectives": {"batch": -1, "chat": {"priority": 10}}, "trust_gateway_headers": True})
    assert dict(cfg.objectives) == {"batch": -1, "chat": 10} and cfg.trust_gateway_headers
    with pytest.raises(ValueError, match="priority must be an integer"):
        config.load({"objectives": {"x": "high"}})
