"""``python -m bench.scrape``: the picker's CPU per scrape of an endpoint's ``/metrics`` (and its
``/health`` probe), the cost that grows with the fleet whatever the request rate.

``--endpoints`` HTTP ports in one child process answer ``GET /metrics`` with a fixed page
(``--page``: by default the two-engine vLLM 0.32 page of ``tests/unit/data``; a simulated
replica's page, ``replica.sim``, is about three times as long) and ``GET /health`` with 200. The
picker's own :class:`~picker.feeds.scrape.Scraper` (real aiohttp over loopback, the shipped
``ScrapeConfig`` but ``--interval``) polls them for ``--seconds`` after a 2 s warm-up, in a child
process of its own; its CPU is that process's threads' run time from
``/proc/self/task/*/schedstat``, divided by the scrapes it completed. Nothing else runs in that
process, so the figure is the scrape's whole cost: HTTP, parsing, the health rules.

``--compare ROOT`` runs the scraper of another tree (e.g. ``git archive`` of main) with the same
ports and page, ``--repeats`` times each, interleaved (this, compare, this, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time

from bench.progressive_envoy import fmt
from kvlaunch.procs import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "unit" / "data" / "vllm_0.32_metrics.txt"


async def serve(ports: list[int], page: bytes) -> None:
    """Answer ``/metrics`` with ``page`` and ``/health`` with 200 on every port, until killed."""
    from aiohttp import web

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    for port in ports:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def measure(ports: list[int], interval: float, seconds: float) -> dict[str, float]:
    """Run the Scraper of the tree on ``sys.path`` over ``ports``: CPU per scrape."""
    from bench.progressive import cpu_s
    from picker.core.config import ScrapeConfig
    from picker.core.endpoints.pool import Pool
    from picker.feeds.discovery.static import parse_list
    from picker.feeds.scrape import Scraper

    pool = Pool()
    pool.set_endpoints(parse_list(",".join(f"127.0.0.1:{p}" for p in ports)))
    async with Scraper(pool, ScrapeConfig(interval_s=interval)) as scraper:
        await asyncio.sleep(2.0)
        c0, n0, t0 = cpu_s(), scraper.own_scrapes, time.monotonic()
        await asyncio.sleep(seconds)
        c1, n1, t1 = cpu_s(), scraper.own_scrapes, time.monotonic()
    scrapes = n1 - n0
    ready = sum(1 for s in pool if s.metrics.updated_at > 0)
    return {
        "ms_per_scrape": (c1 - c0) * 1e3 / max(scrapes, 1),
        "scrapes_per_s": scrapes / (t1 - t0),
        "cores": (c1 - c0) / (t1 - t0),
        "ready": ready,
    }


def run_child(root: str, ports: list[int], args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh process, with ``root`` (this tree: ``""``) first on its path."""
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, str(ROOT)) if p),
    }
    cmd = [sys.executable, "-m", "bench.scrape", "--child", ",".join(map(str, ports))]
    cmd += ["--interval", str(args.interval), "--seconds", str(args.seconds)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scrape", description=__doc__)
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between two scrapes of one endpoint")
    p.add_argument("--seconds", type=float, default=6.0, help="measured seconds per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page", default=str(FIXTURE), help="the /metrics page every endpoint serves")
    p.add_argument("--compare", default="", help="another tree's root, its scraper run side by side")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        ports = [int(x) for x in args.child.split(",")]
        print(json.dumps(asyncio.run(measure(ports, args.interval, args.seconds))))
        return 0
    ports = [free_port() for _ in range(args.endpoints)]
    page = pathlib.Path(args.page)
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import asyncio,sys,pathlib; from bench.scrape import serve; "
            "asyncio.run(serve([int(x) for x in sys.argv[1].split(',')], pathlib.Path(sys.argv[2]).read_bytes()))",
            ",".join(map(str, ports)),
            str(page),
        ],
        cwd=ROOT,
    )
    roots = {"this": "", **({"compare": str(pathlib.Path(args.compare).resolve())} if args.compare else {})}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in roots}
    try:
        time.sleep(2.0)
        for rep in range(args.repeats):
            for name, root in roots.items():
                r = run_child(root, ports, args)
                results[name].append(r)
                print(f"repeat {rep + 1} {name}: {r}", flush=True)
    finally:
        server.terminate()
        server.wait()
    print(
        f"\n{args.endpoints} endpoints every {args.interval} s, page {page.name} ({page.stat().st_size:,} bytes), "
        f"{args.seconds} s per run, {args.repeats} interleaved repeats; median [min-max]\n"
    )
    print("| scraper | CPU ms per scrape | scrapes per s | cores | endpoints ready |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        print(
            f"| {name} | {fmt([r['ms_per_scrape'] for r in rs], 3)} | {fmt([r['scrapes_per_s'] for r in rs], 0)} "
            f"| {fmt([r['cores'] for r in rs], 2)} | {min(int(r['ready']) for r in rs)}/{args.endpoints} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
