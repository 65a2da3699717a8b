"""``python -m picker --help`` states real defaults, and unset routing flags keep the config's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from picker.__main__ import build_config, build_parser
from picker.core import config
from picker.serving.extproc import FULL_DUPLEX
from picker.serving.server import ServerOptions


def _help(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    return " ".join(build_parser().format_help().split())  # wrapping undone


def _flag_help(text: str, flag: str) -> str:
    m = re.search(re.escape(flag) + r" (?:[A-Z_]+|\{[a-z,-]+\}) (.*?)(?= --[a-z]|$)", text)
    assert m, f"{flag} not in help"
    return m.group(1)


def test_help_shows_the_config_defaults_never_none(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help(monkeypatch)
    assert "(default: None)" not in text
    cfg = config.RouterConfig()
    expected = {
        "--policy": cfg.policy,
        "--block-size": cfg.hashing.block_size,
        "--index-capacity": cfg.index.capacity_blocks,
        "--fallbacks": cfg.fallbacks,
        "--max-body-bytes": cfg.max_body_bytes,
        "--scrape-interval": cfg.scrape.interval_s,
    }
    for flag, value in expected.items():
        assert _flag_help(text, flag).endswith(f"(default from config: {value})"), flag
    assert ServerOptions().default_body_mode == FULL_DUPLEX
    assert _flag_help(text, "--body-mode").endswith("(default: full-duplex)")
    assert _flag_help(text, "--grpc-port").endswith(f"(default: {ServerOptions().grpc_port})")


def test_log_level_has_help(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help(monkeypatch)
    assert _flag_help(text, "--log-level").startswith("level of the picker's own log"), text


def test_unset_routing_flags_keep_the_config_file_values(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("index: {capacity_blocks: 777}\nfallbacks: 0\nscrape: {interval_s: 1.5}\n")
    cfg = build_config(build_parser().parse_args(["--config-file", str(path)]))
    assert (cfg.index.capacity_blocks, cfg.fallbacks, cfg.scrape.interval_s) == (777, 0, 1.5)
    cfg = build_config(build_parser().parse_args(["--config-file", str(path), "--index-capacity", "5"]))
    assert cfg.index.capacity_blocks == 5


GIE_CHART_ARGS = [
    *("--pool-group", "inference.networking.x-k8s.io", "--zap-encoder", "json", "-v", "3"),
    *("--tracing", "false", "--ha-enable-leader-election", "--enable-pprof=false"),
    *("--refresh-metrics-interval", "50ms", "--metrics-staleness-threshold", "2s"),
    *("--model-server-metrics-scheme", "http", "--model-server-metrics-path", "/metrics"),
    *("--model-server-metrics-https-insecure-skip-verify", "--total-queued-requests-metric", "x"),
    *("--kv-cache-usage-percentage-metric", "y", "--lora-info-metric", "", "--health-checking"),
    *("--refresh-prometheus-metrics-interval", "5s", "--metrics-endpoint-auth", "true"),
    *("--kubeconfig", "/nope", "--zap-log-level", "debug", "--cache-info-metric", "z"),
]


def test_gie_chart_flags_are_accepted_and_acted_on_where_they_map(tmp_path: Path) -> None:
    from picker.serving import gie_flags

    gie_cfg = tmp_path / "default-plugins.yaml"
    gie_cfg.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: prefix-cache-scorer\nschedulingProfiles:\n- name: default\n"
    )
    args = build_parser().parse_args(
        [*GIE_CHART_ARGS, "--config-file", str(gie_cfg), "--endpoints", "1.2.3.4:8"]
    )
    cfg = build_config(args)
    assert cfg.policy == config.RouterConfig().policy, "GIE's plugin config leaves kvpick's defaults"
    assert (cfg.scrape.interval_s, cfg.scrape.stale_after_s) == (0.05, 2.0)
    assert gie_flags.log_level(args) == "debug" and args.tracing is False and args.ha_enable_leader_election
    assert [gie_flags.duration(d) for d in ("1m30s", "250ms", "2", "1h")] == [90.0, 0.25, 2.0, 3600.0]
