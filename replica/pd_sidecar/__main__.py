"""``python -m replica.pd_sidecar --port 8000 --vllm http://127.0.0.1:8001``: the decode-side P/D
sidecar (:mod:`replica.pd_sidecar.server`) in front of one decode vLLM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from replica.pd_sidecar.server import CONNECTORS, SidecarConfig, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica.pd_sidecar", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="where Envoy sends the decode pod's requests")
    p.add_argument("--vllm", default="http://127.0.0.1:8001", help="the local vLLM's base URL")
    p.add_argument("--connector", choices=CONNECTORS, default="shared-storage")
    p.add_argument("--prefill-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--allow-prefillers",
        default="",
        help="comma-separated CIDRs a prefiller's address must be in (empty: any)",
    )
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = SidecarConfig(
            vllm=a.vllm.rstrip("/"),
            connector=a.connector,
            prefill_timeout_s=a.prefill_timeout_s,
            allow_prefillers=tuple(n.strip() for n in a.allow_prefillers.split(",") if n.strip()),
        )
    except ValueError as exc:
        print(f"replica.pd_sidecar: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg, a.host, a.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
