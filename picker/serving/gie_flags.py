"""GIE EPP flags that ``python -m picker`` accepts so it can replace GIE's EPP in its chart.

The flags kept are those GIE's and llm-d-router's charts pass (GIE ``config/charts/epplib/
templates/_deployment.yaml`` at 1748e829, llm-d-router ``config/charts/routerlib/templates/
_deployment.yaml`` at ebab687), those their READMEs give as ``flags`` examples (``v``), and those
kvpick acts on. The ones both share with kvpick under the same name (``--pool-name``,
``--grpc-port``, ``--secure-serving``, ``--config-file``...) are kvpick's own flags, not here.
Go flag syntax is accepted: ``--flag=value``, ``--flag value``, a bare boolean ``--flag``, and Go
durations (``50ms``, ``2s``, ``1m``).

Acted on: ``--refresh-metrics-interval`` (scrape interval), ``--metrics-staleness-threshold``
(scrape staleness), ``-v`` / ``--v`` and ``--zap-log-level`` (log level, when ``--log-level`` is
not given), ``--pool-group`` and ``--model-server-metrics-path`` when they name what kvpick does
anyway (``inference.networking.k8s.io``; ``/metrics``), ``--config-file`` holding a GIE
``EndpointPickerConfig`` (kvpick keeps its own policies; see :func:`is_gie_config`). The rest
(:data:`IGNORED`) are accepted, and :func:`report` names the ones given in one log line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.core.config import ScrapeConfig

log = logging.getLogger("picker")

DEFAULT_POOL_GROUP = "inference.networking.k8s.io"
METRICS_PATH = "/metrics"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Ignored:
    """A GIE flag kvpick accepts and does not act on."""

    flag: str
    kind: str
    """``bool``, ``str`` or ``duration``: how the value parses."""
    help: str
    """What the flag sets in GIE, and in parentheses what kvpick does instead (``--help``)."""
    same: tuple[object, ...] = ()
    """Values that ask for what kvpick does anyway; any other value is reported as a WARNING.
    Empty: every value is harmless (the flag only changes how GIE looks, not what it routes)."""


IGNORED: tuple[Ignored, ...] = (
    Ignored("--zap-encoder", "str", "GIE's log encoding, json or console (kvpick logs plain text)"),
    Ignored("--tracing", "bool", "GIE's OpenTelemetry tracing (kvpick has none)", (False,)),
    Ignored(
        "--ha-enable-leader-election",
        "bool",
        "GIE's one elected active replica (kvpick's replicas are all active, sharing picks over --peers)",
        (False,),
    ),
    Ignored(
        "--metrics-endpoint-auth",
        "bool",
        "GIE's Kubernetes token check on /metrics (kvpick's: a static bearer token, --metrics-token-file)",
        (False,),
    ),
    Ignored(
        "--total-queued-requests-metric",
        "str",
        "GIE's metric name for queued requests (kvpick reads vLLM's)",
        ("vllm:num_requests_waiting",),
    ),
    Ignored(
        "--total-running-requests-metric",
        "str",
        "GIE's metric name for running requests (kvpick reads vLLM's)",
        ("vllm:num_requests_running",),
    ),
    Ignored(
        "--kv-cache-usage-percentage-metric",
        "str",
        "GIE's metric name for KV-cache usage (kvpick reads vLLM's)",
        ("vllm:kv_cache_usage_perc",),
    ),
    Ignored(
        "--lora-info-metric",
        "str",
        "GIE's metric name for LoRA adapters (kvpick reads vLLM's)",
        ("vllm:lora_requests_info", ""),
    ),
    Ignored(
        "--cache-info-metric",
        "str",
        "GIE's metric name for the KV-cache config (kvpick reads vLLM's)",
        ("vllm:cache_config_info",),
    ),
)


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


_TYPES: dict[str, Callable[[str], Any]] = {"bool": go_bool, "str": str, "duration": duration}

GROUP_TITLE = "GIE EPP compatibility"


def add_flags(p: argparse.ArgumentParser) -> None:
    """GIE's own flags, as the last group of ``--help``."""
    g = p.add_argument_group(
        GROUP_TITLE,
        "Flags of GIE's EPP that its Helm chart passes, so kvpick can replace it there (those "
        "kvpick shares, such as --pool-name, are above). The ignored ones given are named in one "
        "log line at start.",
    )
    g.add_argument(
        "--pool-group",
        default=None,
        metavar="GROUP",
        help=f"API group of the InferencePool; kvpick reads {DEFAULT_POOL_GROUP}/v1 and warns at "
        "start when another is given",
    )
    g.add_argument(
        "-v",
        "--v",
        dest="gie_v",
        type=int,
        default=None,
        metavar="N",
        help="GIE's log verbosity, a number: 4 or more is --log-level debug, less is info "
        "(used when --log-level is not given)",
    )
    g.add_argument(
        "--zap-log-level",
        default=None,
        metavar="LEVEL",
        help="GIE's log level: debug, info, warn, error, or a verbosity number as for -v (used "
        "when --log-level is not given)",
    )
    g.add_argument(
        "--refresh-metrics-interval",
        type=duration,
        default=None,
        metavar="DURATION",
        help="time between /metrics scrapes of each endpoint, as a Go duration (50ms) or seconds; "
        f"--scrape-interval wins when both are given (default from config: {ScrapeConfig().interval_s})",
    )
    g.add_argument(
        "--metrics-staleness-threshold",
        type=duration,
        default=None,
        metavar="DURATION",
        help="an endpoint with no successful /metrics scrape for this long (a Go duration or "
        f"seconds) is marked degraded, still routable (default from config: {ScrapeConfig().stale_after_s})",
    )
    g.add_argument(
        "--model-server-metrics-path",
        default=None,
        metavar="PATH",
        help=f"URL path of the endpoints' metrics; kvpick scrapes {METRICS_PATH} and warns at "
        "start when another is given",
    )
    for ig in IGNORED:
        metavar = "BOOL" if ig.kind == "bool" else "NAME" if ig.flag.endswith("-metric") else "VALUE"
        kwargs: dict[str, Any] = {"nargs": "?", "const": True} if ig.kind == "bool" else {}
        g.add_argument(
            ig.flag,
            type=_TYPES[ig.kind],
            default=None,
            metavar=metavar,
            help=f"ignored: {ig.help}",
            **kwargs,
        )


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


def ignored_given(args: argparse.Namespace) -> list[tuple[str, object, bool]]:
    """The GIE flags given that kvpick does not act on: ``(flag, value, harmless)``, where
    ``harmless`` means the value asks for what kvpick does anyway."""
    given = vars(args)
    out: list[tuple[str, object, bool]] = []
    if args.pool_group not in (None, DEFAULT_POOL_GROUP):
        out.append(("--pool-group", args.pool_group, False))
    if args.model_server_metrics_path not in (None, METRICS_PATH):
        out.append(("--model-server-metrics-path", args.model_server_metrics_path, False))
    for ig in IGNORED:
        value = given.get(ig.flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out.append((ig.flag, value, not ig.same or value in ig.same))
    return out


def report(args: argparse.Namespace) -> None:
    """One log line naming every GIE flag given that kvpick does not act on: INFO when each asks
    for what kvpick does anyway, else WARNING (the deployment expects something kvpick won't do)."""
    ignored = ignored_given(args)
    if not ignored:
        return
    harmless = all(ok for _, _, ok in ignored)
    log.log(
        logging.INFO if harmless else logging.WARNING,
        "GIE flags accepted and not acted on (see --help, %s): %s",
        GROUP_TITLE,
        ", ".join(f"{flag}={value!r}" for flag, value, _ in ignored),
    )


def is_gie_config(raw: Mapping[str, Any] | None) -> bool:
    """Whether a config file is GIE's ``EndpointPickerConfig`` (its chart mounts one)."""
    return isinstance(raw, Mapping) and (
        raw.get("kind") == "EndpointPickerConfig"
        or str(raw.get("apiVersion", "")).startswith("inference.networking")
    )
