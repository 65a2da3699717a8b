"""``python -m picker --help``: what each flag does, its unit and its default once, in the order a
user sets them; unset routing flags keep the config's; GIE's chart flags are accepted."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pytest

from picker.__main__ import build_config, build_parser
from picker.core import config
from picker.feeds.drain import INTERVAL_S
from picker.serving import gie_flags
from picker.serving.extproc import FULL_DUPLEX
from picker.serving.server import ServerOptions
from picker.serving.workers import WORKER_FLAG


def _helps() -> dict[str, str]:
    """Each shown flag's help as ``--help`` prints it (with the default the formatter appends)."""
    parser = build_parser()
    formatter = parser._get_formatter()
    return {
        action.option_strings[-1]: " ".join(formatter._expand_help(action).split())
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS
    }


def test_help_shows_the_config_defaults_never_none() -> None:
    helps = _helps()
    assert not [f for f, h in helps.items() if "None" in h]
    cfg = config.RouterConfig()
    expected = {
        "--policy": cfg.policy,
        "--block-size": cfg.hashing.block_size,
        "--index-capacity": cfg.index.capacity_blocks,
        "--fallbacks": cfg.fallbacks,
        "--max-body-bytes": cfg.max_body_bytes,
        "--scrape-interval": cfg.scrape.interval_s,
        "--metrics-staleness-threshold": cfg.scrape.stale_after_s,
    }
    for flag, value in expected.items():
        assert helps[flag].endswith(f"(default from config: {value})"), flag
    assert ServerOptions().default_body_mode == FULL_DUPLEX
    assert helps["--body-mode"].endswith("(default: full-duplex)")
    assert helps["--grpc-port"].endswith(f"(default: {ServerOptions().grpc_port})")
    assert helps["--message-interval"].endswith(f"(default: {INTERVAL_S})")


def test_every_flag_says_what_it_does_and_states_its_default_once() -> None:
    parser = build_parser()
    hidden = {a.option_strings[0] for a in parser._actions if a.help == argparse.SUPPRESS}
    assert hidden == {WORKER_FLAG, "--worker-dir"}, "only the workers' internal flags are hidden"
    for flag, text in _helps().items():
        assert 20 <= len(text) <= 320, (flag, len(text), text)
        assert len(re.findall(r"\(default", text)) <= 1, (flag, text)
        rest = re.sub(r"\(default[^)]*\)", "", text)
        assert not re.search(r"\bdefault\b", rest), f"{flag} states a default outside (default ...): {text}"


UNITS = {"PORT", "SECONDS", "DURATION", "BYTES", "BLOCKS", "STREAMS", "N"}


def test_every_numeric_flag_names_its_unit() -> None:
    for action in build_parser()._actions:
        if action.help == argparse.SUPPRESS or action.type not in (int, float, gie_flags.duration):
            continue
        assert action.metavar in UNITS, (action.option_strings, action.metavar)


def test_help_opens_with_endpoints_and_ends_with_gie() -> None:
    groups = [g for g in build_parser()._action_groups if g._group_actions]
    titles = [g.title for g in groups]
    assert titles[:5] == ["options", "endpoints", "ports", "policy and load", "prefix matching"], titles
    assert titles[-1] == gie_flags.GROUP_TITLE, titles
    gie = {o for a in groups[-1]._group_actions for o in a.option_strings}
    assert gie >= {i.flag for i in gie_flags.IGNORED} | {"--pool-group", "-v", "--v"}


def test_log_level_has_help() -> None:
    assert _helps()["--log-level"].startswith("level of the picker's own log"), _helps()["--log-level"]


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
