"""GIE EPP flags that ``python -m picker`` accepts so it can replace GIE's EPP in its chart.

GIE's ``cmd/epp/runner/options.go`` and its chart's ``epp-deployment.yaml`` pass these. Each is
acted on where kvpick has the same knob, or else ignored with one log line naming it; none makes
the picker exit. Go flag syntax is accepted: ``--flag=value``, ``--flag value``, a bare boolean
``--flag``, and Go durations (``50ms``, ``2s``, ``1m``).

Acted on: ``--refresh-metrics-interval`` (scrape interval), ``--metrics-staleness-threshold``
(scrape staleness), ``-v`` and ``--zap-log-level`` (log level, when ``--log-level`` is not
given), ``--model-server-metrics-path`` and ``--pool-group`` when they name what kvpick already
does (``/metrics``; ``inference.networking.k8s.io``), ``--config-file`` holding a GIE
``EndpointPickerConfig`` (kvpick keeps its own policies; see :func:`is_gie_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from picker.core.config import ScrapeConfig

log = logging.getLogger("picker")

DEFAULT_POOL_GROUP = "inference.networking.k8s.io"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

# (flag, kind, GIE's default); kind: "bool", "int", "str" or "duration".
IGNORED: tuple[tuple[str, str, object], ...] = (
    ("--zap-encoder", "str", None),
    ("--zap-devel", "bool", None),
    ("--zap-stacktrace-level", "str", None),
    ("--zap-time-encoding", "str", None),
    ("--kubeconfig", "str", None),
    ("--tracing", "bool", True),
    ("--health-checking", "bool", False),
    ("--enable-pprof", "bool", True),
    ("--metrics-endpoint-auth", "bool", True),
    ("--ha-enable-leader-election", "bool", False),
    ("--model-server-metrics-scheme", "str", "http"),
    ("--model-server-metrics-port", "int", 0),
    ("--model-server-metrics-https-insecure-skip-verify", "bool", True),
    ("--refresh-prometheus-metrics-interval", "duration", 5.0),
    ("--total-queued-requests-metric", "str", "vllm:num_requests_waiting"),
    ("--total-running-requests-metric", "str", "vllm:num_requests_running"),
    ("--kv-cache-usage-percentage-metric", "str", "vllm:kv_cache_usage_perc"),
    ("--lora-info-metric", "str", "vllm:lora_requests_info"),
    ("--cache-info-metric", "str", "vllm:cache_config_info"),
    ("--config-text", "str", None),
)
WHY = {
    "--tracing": "kvpick emits no traces",
    "--ha-enable-leader-election": "kvpick replicas are active-active (see the chart's notes on the hit rate)",
    "--config-text": "kvpick's configuration is --config-file in its own format",
    "--model-server-metrics-port": "kvpick scrapes each endpoint's own port",
}


def duration(text: str) -> float:
    """A Go duration (``1m30s``, ``50ms``) or plain seconds, in seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}")
    return sum(float(n) * _UNIT[u] for n, u in parts)


def go_bool(text: str) -> bool:
    v = text.lower()
    if v in ("1", "t", "true", "yes", "on"):
        return True
    if v in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


_TYPES: dict[str, Callable[[str], Any]] = {"bool": go_bool, "int": int, "str": str, "duration": duration}


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "GIE EPP compatibility",
        "Accepted so kvpick can replace GIE's EPP in its chart; acted on where kvpick has the same "
        "knob, otherwise ignored with one log line.",
    )
    g.add_argument(
        "--pool-group", default=None, help=f"InferencePool API group (kvpick reads {DEFAULT_POOL_GROUP})"
    )
    g.add_argument("-v", dest="gie_v", type=int, default=None, help="log verbosity (>= 4: debug)")
    g.add_argument("--zap-log-level", default=None, help="log level (debug, info, error or a number)")
    g.add_argument("--refresh-metrics-interval", type=duration, default=None, help="scrape interval")
    g.add_argument("--metrics-staleness-threshold", type=duration, default=None, help="metrics staleness")
    g.add_argument("--model-server-metrics-path", default=None, help="kvpick scrapes /metrics")
    for flag, kind, _ in IGNORED:
        if kind == "bool":
            g.add_argument(flag, type=go_bool, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, type=_TYPES[kind], default=None, help=argparse.SUPPRESS)


def log_level(args: argparse.Namespace) -> str | None:
    """The log level GIE's ``-v`` / ``--zap-log-level`` ask for, or None."""
    if args.zap_log_level:
        z = args.zap_log_level.lower()
        if z.isdigit():
            return "debug" if int(z) >= 4 else "info"
        return {"debug": "debug", "info": "info", "warn": "warning", "error": "error"}.get(z, "info")
    if args.gie_v is not None:
        return "debug" if args.gie_v >= 4 else "info"
    return None


def scrape_config(args: argparse.Namespace, base: ScrapeConfig) -> ScrapeConfig:
    """``base`` with what GIE's ``--refresh-metrics-interval`` and
    ``--metrics-staleness-threshold`` set (kvpick's own ``--scrape-interval`` is applied later)."""
    cfg = base
    if args.refresh_metrics_interval is not None:
        cfg = dataclasses.replace(cfg, interval_s=max(float(args.refresh_metrics_interval), 0.01))
    if args.metrics_staleness_threshold is not None:
        cfg = dataclasses.replace(cfg, stale_after_s=float(args.metrics_staleness_threshold))
    return cfg


def report(args: argparse.Namespace) -> None:
    """One log line per GIE flag given that kvpick does not act on."""
    given = vars(args)
    for flag, _, _ in IGNORED:
        value = given.get(flag.lstrip("-").replace("-", "_"))
        if value is not None:
            log.info(
                "GIE flag %s=%r accepted and ignored: %s", flag, value, WHY.get(flag, "no kvpick equivalent")
            )
    if args.pool_group not in (None, DEFAULT_POOL_GROUP):
        log.warning(
            "GIE flag --pool-group=%s ignored: kvpick reads %s/v1 InferencePools",
            args.pool_group,
            DEFAULT_POOL_GROUP,
        )
    if args.model_server_metrics_path not in (None, "/metrics"):
        log.warning(
            "GIE flag --model-server-metrics-path=%s ignored: kvpick scrapes /metrics",
            args.model_server_metrics_path,
        )


def is_gie_config(raw: Mapping[str, Any] | None) -> bool:
    """Whether a config file is GIE's ``EndpointPickerConfig`` (its chart mounts one)."""
    return isinstance(raw, Mapping) and (
        raw.get("kind") == "EndpointPickerConfig"
        or str(raw.get("apiVersion", "")).startswith("inference.networking")
    )
