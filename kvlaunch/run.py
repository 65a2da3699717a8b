"""``make run``: the embedded local stack — a real Envoy, the picker and N simulated replicas.

    python -m kvlaunch.run --replicas 4 --policy cost

Checks every port it needs before starting anything (a port in use: exit 1, naming it). Then
prints where to send requests, and a status line per replica (requests, prefix-cache hit rate,
queue) read from each replica's vLLM-style ``/metrics``: redrawn in place on a terminal, else
(``make run | tee log``) one plain timestamped line for all replicas every ``--status-interval``.
Envoy listens on 127.0.0.1 unless ``--listen-host`` says otherwise.

Stopping: Ctrl-C, SIGTERM and SIGHUP (the terminal closed) all stop every child process group and
wait for it, so nothing is left behind. The children run in their own sessions, so a terminal's
signals reach only this process, which is the one place that stops them. A signal during
startup stops it at once (no traceback), killing the children started so far.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import pathlib
import shlex
import signal
import socket
import sys
import time
import urllib.request

from kvlaunch import PY, ROOT, Procs, Stack, wait_port
from picker.feeds.scrape import parse_metrics
from replica.sim.__main__ import parser as sim_parser
from replica.sim.costmodel import profile

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """A stop signal arrived."""


class StopFlag:
    """Signal handler that only records the signal; the main loop and every startup wait poll
    ``check``, so a stop is prompt but never tears through ``Popen`` or the clean-up."""

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)

    def check(self) -> None:
        if self.signum:
            raise Interrupted(signal.Signals(self.signum).name)

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.check()
            time.sleep(min(0.05, left))
        self.check()


def replica_status(port: int, compact: bool = False) -> str:
    """One replica's figures from its ``/metrics``; ``compact``: the plain (non-terminal) form."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
    except OSError as exc:
        return f"unreachable ({exc.__class__.__name__})"
    m = parse_metrics(text)
    hit = m.prefix_hits_total / m.prefix_queries_total if m.prefix_queries_total else 0.0
    if compact:
        return (
            f"req {int(m.request_success_total)} hit {hit:.1%} run {int(m.running)} "
            f"wait {int(m.waiting)} kv {m.kv_usage:.1%}"
        )
    return (
        f"requests {int(m.request_success_total):>6}  hit rate {hit:6.1%}  "
        f"running {int(m.running):>3}  waiting {int(m.waiting):>3}  kv {m.kv_usage:5.1%}"
    )


def ports_needed(args: argparse.Namespace) -> dict[int, str]:
    """Every port the stack binds -> what binds it and the flag that moves it."""
    need: dict[int, str] = {}
    for port, what in [
        (args.port, "Envoy listener (--port)"),
        (args.admin_port, "Envoy admin (--admin-port)"),
        (args.picker_port, "picker ext_proc (--picker-port)"),
        (args.picker_port + 1, "picker gRPC health (--picker-port + 1)"),
        (args.metrics_port, "picker metrics (--metrics-port)"),
        (args.metrics_port + 1, "picker debug API (--metrics-port + 1)"),
        *((args.base_port + i, f"replica {i} (--base-port + {i})") for i in range(args.replicas)),
    ]:
        if port in need:
            raise ValueError(f"port {port} is both the {need[port]} and the {what}")
        need[port] = what
    return need


def port_problem(port: int) -> str | None:
    """Why ``port`` cannot be bound, or None. A bind to the wildcard address fails while a listener
    holds the port on any local address; SO_REUSEADDR, as servers set it, lets connections in
    TIME_WAIT not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            return "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
    return None


def check_ports(args: argparse.Namespace) -> str | None:
    """None when every port the stack needs is free, else why not (naming the port)."""
    try:
        need = ports_needed(args)
    except ValueError as exc:
        return str(exc)
    for port, what in need.items():
        if not 0 < port < 65536:
            return f"port {port} for the {what} is not a TCP port"
        if (problem := port_problem(port)) is not None:
            return f"port {port} {problem} (wanted for the {what}): free it, or choose another port"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvlaunch.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--policy", default="cost", help="picker policy: cost, round-robin, least-loaded")
    p.add_argument("--port", type=int, default=8080, help="Envoy listener port")
    p.add_argument(
        "--listen-host",
        default="127.0.0.1",
        help="address Envoy listens on (0.0.0.0: reachable from other machines)",
    )
    p.add_argument("--base-port", type=int, default=8001, help="first replica port")
    p.add_argument(
        "--picker-port", type=int, default=9002, help="picker ext_proc port (+1 health; metrics 9090)"
    )
    p.add_argument("--metrics-port", type=int, default=9090)
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument(
        "--sim-args",
        default="",
        help="extra arguments for every replica (python -m replica.sim), e.g. "
        "'--profile h100-llama-3.1-8b --time-scale 0.1'",
    )
    p.add_argument(
        "--request-timeout",
        default="30s",
        help="Envoy answers a JSON 408 to a request not received whole within this "
        "(render.py --request-timeout)",
    )
    p.add_argument(
        "--envoy-args",
        default="",
        help="extra render.py flags for Envoy's config, e.g. '--max-connections 1000 --picker-streams 512'",
    )
    p.add_argument("--run-dir", default=str(ROOT / ".run"), help="logs and generated configs")
    p.add_argument(
        "--status-interval",
        type=float,
        default=None,
        help="seconds between status updates (default: 1 on a terminal, 5 otherwise)",
    )
    p.add_argument(
        "--once", action="store_true", help="print one status block and keep running without updates"
    )
    a = p.parse_args(argv)
    try:  # a misspelt replica flag or profile fails here, before anything starts
        sim = sim_parser().parse_args(["--port", "0", *shlex.split(a.sim_args)])
        profile(sim.profile)
    except ValueError as exc:
        p.error(f"--sim-args: {exc}")
    return a


def start(args: argparse.Namespace, procs: Procs) -> list[int]:
    """The replicas, then the picker and Envoy through the shared launcher (:class:`kvlaunch.Stack`);
    returns the replicas' ports once every port accepts connections."""
    ports = [args.base_port + i for i in range(args.replicas)]
    for i, port in enumerate(ports):
        sim = [
            PY,
            "-m",
            "replica.sim",
            "--port",
            str(port),
            "--model",
            args.model,
            *shlex.split(args.sim_args),
        ]
        procs.start(f"replica-{i}", sim)
    st = Stack(
        procs,
        ports,
        listen_host=args.listen_host,
        envoy_port=args.port,
        admin_port=args.admin_port,
        grpc_port=args.picker_port,
        health_port=args.picker_port + 1,
        metrics_port=args.metrics_port,
        debug_port=args.metrics_port + 1,  # a local stack: the debug API on loopback, next to metrics
    )
    st.start_picker("--policy", args.policy)
    st.start_envoy(
        "--upstream",
        "pool",
        "--endpoints",
        ",".join(st.addresses),
        "--request-timeout",
        args.request_timeout,
        *shlex.split(args.envoy_args),
    )
    for port in ports:
        wait_port(port, 60, procs=procs)
    return ports


def banner(args: argparse.Namespace, ports: list[int]) -> str:
    return f"""
kvpick local stack is up: Envoy {args.listen_host}:{args.port} → picker :{args.picker_port} (policy {args.policy}) → {len(ports)} simulated replicas :{ports[0]}-{ports[-1]}

  curl -s http://127.0.0.1:{args.port}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model": "{args.model}", "prompt": "You are a helpful assistant. Hello!", "max_tokens": 16}}'

  explain a pick:  curl -s 'http://127.0.0.1:{args.metrics_port + 1}/debug/explain?path=/v1/completions' \\
       -H "authorization: Bearer $(cat {args.run_dir}/debug-token)" -d '{{"model": "{args.model}", "prompt": "..."}}'
  Envoy → picker is mTLS (a throwaway CA in {args.run_dir}/pki); the debug API needs the bearer token above.
  picker metrics:  http://127.0.0.1:{args.metrics_port}/metrics      logs: {args.run_dir}/
Ctrl-C stops everything.
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = pathlib.Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if (clash := check_ports(args)) is not None:
        _say(f"kvpick local stack not started: {clash}", err=True)
        return 1
    flag = StopFlag()
    flag.install()
    procs = Procs(run_dir, flag)
    up = False
    try:
        ports = start(args, procs)
        up = True
        print(banner(args, ports), flush=True)
        tty = sys.stdout.isatty()
        interval = args.status_interval or (1.0 if tty else 5.0)
        drawn = False
        while True:
            procs.check()
            if not (args.once and drawn):
                _status(ports, tty, redraw=drawn)
                drawn = True
            flag.sleep(interval)
    except Interrupted as exc:
        _say(f"\n{exc}{'' if up else ' during startup'}: stopping.")
        return 0
    except (RuntimeError, OSError) as exc:  # OSError: also the terminal gone under a redraw (SIGHUP)
        if isinstance(exc, OSError) and not isinstance(exc, TimeoutError) and flag.signum:
            return 0
        _say(f"\nstack failed: {exc}", err=True)
        return 1
    finally:
        procs.stop()
        _say("stopped: envoy, picker and replicas are down.")


def _status(ports: list[int], tty: bool, redraw: bool) -> None:
    """On a terminal, a block of one line per replica, drawn over the last one (``redraw``);
    elsewhere (a pipe, a file), one plain timestamped line for all replicas."""
    if tty:
        lines = [f"  replica :{p}  {replica_status(p)}\x1b[K" for p in ports]
        sys.stdout.write((f"\x1b[{len(lines)}F" if redraw else "") + "\n".join(lines) + "\n")
    else:
        status = " | ".join(f":{p} {replica_status(p, compact=True)}" for p in ports)
        sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {status}\n")
    sys.stdout.flush()


def _say(text: str, err: bool = False) -> None:
    """Print, unless the terminal is gone (after SIGHUP): nothing may stop the clean-up."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
