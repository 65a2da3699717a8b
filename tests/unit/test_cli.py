"""``python -m picker --help`` states real defaults, and unset routing flags keep the config's."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from picker.__main__ import build_config, build_parser
from picker.core import config
from picker.serving import gie_flags
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


# GIE's own flags as GIE's chart renders them (config/charts/epplib/templates/_deployment.yaml at
# 1748e829): two replicas, tracing off, metrics auth off, `inferenceExtension.flags: {v: 3}` (its
# README's example), and the model-server flags of its sglang, triton and trtllm-serve branches.
# llm-d-router's chart (config/charts/routerlib/templates/_deployment.yaml at ebab687) passes the
# same but for the model-server ones. The flags kvpick shares (--pool-name, --pool-namespace,
# --config-file, --grpc-health-port, --secure-serving) are tested with kvpick's chart (tests/chart).
GIE_CHART_ARGS = [
    *("--pool-group", "inference.networking.k8s.io"),
    '--total-queued-requests-metric="sglang:num_queue_reqs"',
    '--total-running-requests-metric="sglang:num_running_reqs"',
    '--kv-cache-usage-percentage-metric="sglang:token_usage"',
    '--cache-info-metric="sglang:cache_config_info"',
    *("--lora-info-metric", ""),
    '--model-server-metrics-path="/prometheus/metrics"',
    *("--zap-encoder", "json", "--ha-enable-leader-election", "--v=3"),
    *("--tracing=false", "--metrics-endpoint-auth=false"),
]
IGNORED_IN_CHART_ARGS = {i.flag for i in gie_flags.IGNORED} | {"--model-server-metrics-path"}


def test_gie_chart_flags_are_accepted_and_acted_on_where_they_map(tmp_path: Path) -> None:
    gie_cfg = tmp_path / "default-plugins.yaml"
    gie_cfg.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: prefix-cache-scorer\nschedulingProfiles:\n- name: default\n"
    )
    args = build_parser().parse_args([*GIE_CHART_ARGS, "--config-file", str(gie_cfg)])
    cfg = build_config(args)
    assert cfg.policy == config.RouterConfig().policy, "GIE's plugin config leaves kvpick's defaults"
    assert gie_flags.log_level(args) == "info" and args.tracing is False and args.ha_enable_leader_election
    assert {flag for flag, _, _ in gie_flags.ignored_given(args)} == IGNORED_IN_CHART_ARGS


def test_gie_flags_kvpick_acts_on() -> None:
    parse = build_parser().parse_args
    args = parse(["--refresh-metrics-interval", "50ms", "--metrics-staleness-threshold", "2s"])
    cfg = build_config(args)
    assert (cfg.scrape.interval_s, cfg.scrape.stale_after_s) == (0.05, 2.0)
    assert gie_flags.ignored_given(args) == []
    assert (
        build_config(parse(["--refresh-metrics-interval=1s", "--scrape-interval=3"])).scrape.interval_s == 3
    )
    assert gie_flags.log_level(parse(["--zap-log-level", "debug"])) == "debug"
    assert gie_flags.log_level(parse(["-v", "4"])) == gie_flags.log_level(parse(["--v=4"])) == "debug"
    assert [gie_flags.duration(d) for d in ("1m30s", "250ms", "2", "1h")] == [90.0, 0.25, 2.0, 3600.0]


@pytest.mark.parametrize(
    "flag", ["--enable-pprof=false", "--health-checking", "--kubeconfig=/k", "--config-text=x", "--zap-devel"]
)
def test_gie_flags_its_chart_does_not_pass_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag])
    assert "unrecognized arguments" in capsys.readouterr().err


def _report(argv: list[str], caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="picker"):
        gie_flags.report(build_parser().parse_args(argv))
    return list(caplog.records)


def test_ignored_gie_flags_are_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    records = _report(
        ["--zap-encoder", "json", "--tracing=false", "--ha-enable-leader-election=false"], caplog
    )
    assert len(records) == 1 and records[0].levelno == logging.INFO, "each asks for what kvpick does"
    line = records[0].getMessage()
    for given in ("--zap-encoder='json'", "--tracing=False", "--ha-enable-leader-election=False"):
        assert given in line, line
    records = _report(GIE_CHART_ARGS, caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING, "sglang's metric names, HA"
    assert all(flag in records[0].getMessage() for flag in IGNORED_IN_CHART_ARGS), records[0].getMessage()
    assert _report(["--pool-group", "inference.networking.k8s.io", "-v", "2"], caplog) == []
