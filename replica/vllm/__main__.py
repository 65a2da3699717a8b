"""``python -m replica.vllm serve [MODEL] [vLLM args]``: print the effective config, then exec
vLLM's OpenAI server with the prefix-aware scheduler (see ``launcher.py``). Our own flags come
before the vLLM args: ``--kv-events-endpoint`` (default ``tcp://*:5557``) and ``--async``
(``PrefixAwareAsyncScheduler``; the default when CUDA is available)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from replica.vllm.launcher import build_command, effective_config


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica.vllm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser(
        "serve", allow_abbrev=False, help="run vLLM's OpenAI server with the kvpick scheduler"
    )
    serve.add_argument("--kv-events-endpoint", default="tcp://*:5557")
    serve.add_argument("--async", dest="async_", action="store_true", default=None)
    serve.add_argument("--print-only", action="store_true", help="print the config and exit")
    a, rest = p.parse_known_args(argv)
    model = rest.pop(0) if rest and not rest[0].startswith("-") else None
    cmd = build_command(model, rest, a.kv_events_endpoint, a.async_ if a.async_ is not None else _cuda())
    try:
        config = effective_config(cmd, os.environ)
    except ValueError as e:
        print(f"replica.vllm: bad configuration: {e}", file=sys.stderr)
        return 2
    print(json.dumps(config, indent=2), flush=True)
    if a.print_only:
        return 0
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
