"""The command line of a kvpick replica: vLLM's OpenAI server with our scheduler, prefix caching,
KV events over ZMQ, and cached-token counts in ``usage`` (what the picker reads)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence

SERVER = "vllm.entrypoints.openai.api_server"
SYNC_CLS = "replica.vllm.scheduler.PrefixAwareScheduler"
ASYNC_CLS = "replica.vllm.scheduler.PrefixAwareAsyncScheduler"


def kv_events_config(endpoint: str, topic: str = "kv") -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic},
        separators=(",", ":"),
    )


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def build_command(
    model: str | None,
    user_args: Sequence[str],
    kv_events_endpoint: str = "tcp://*:5557",
    async_scheduling: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with our defaults, then the user's args.
    A default is left out when the user gives the same flag (``--flag v`` or ``--flag=v``), so
    the user's choice always wins. ``model`` may be None when the user passes ``--model``."""
    assert model is not None or _given(user_args, "--model"), "a model is required (MODEL or --model)"
    defaults: list[tuple[str, str | None]] = [
        ("--model", model),
        ("--scheduler-cls", ASYNC_CLS if async_scheduling else SYNC_CLS),
        ("--enable-prefix-caching", None),
        ("--enable-prompt-tokens-details", None),
        ("--kv-events-config", kv_events_config(kv_events_endpoint)),
    ]
    argv = [python, "-m", SERVER]
    for flag, value in defaults:
        if _given(user_args, flag) or (flag == "--model" and model is None):
            continue
        argv += [flag] if value is None else [flag, value]
    return [*argv, *user_args]


def effective_config(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, object]:
    """What is about to run: the command and the scheduler options it will read."""
    from replica.vllm.options import load_options

    opts = load_options(env)
    return {
        "command": list(argv),
        "scheduler_options": {
            "cache_aware_admission": opts.cache_aware_admission,
            "aging_s": opts.aging_s,
        },
        "env": {k: v for k, v in sorted(env.items()) if k.startswith(("KVPICK_", "VLLM_", "HF_HUB_OFFLINE"))},
    }
