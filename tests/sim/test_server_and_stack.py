"""The simulator's HTTP server over loopback, and `make run` end to end."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import time
from http.client import HTTPConnection
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import PY, ROOT, Procs, free_port, http, post_json, wait_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "You are a careful assistant. " * 20  # 580 chars = 145 tokens = 9 full blocks of 16


@pytest.fixture
def sim(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    procs = Procs(tmp_path)
    port = free_port()
    proc = procs.start("sim", [PY, "-m", "replica.sim", "--port", str(port), "--profile", "cpu-test"])
    wait_port(port, proc=proc)
    yield f"http://127.0.0.1:{port}"
    procs.stop()


def metrics(url: str) -> dict[str, float]:
    _, body, _ = http("GET", url + "/metrics")
    return {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_completion_reports_cached_tokens_and_metrics(sim: str) -> None:
    status, first = post_json(sim + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and first["usage"]["prompt_tokens"] == 145
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, second = post_json(
        sim + "/v1/completions", {"model": MODEL, "prompt": PROMPT + " again", "max_tokens": 4}
    )
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 144, "9 full blocks of 16 hit"
    m = metrics(sim)
    assert m["vllm:prefix_cache_hits_total"] == 144
    assert m["vllm:prefix_cache_queries_total"] == 145 + 147
    assert m["vllm:request_success_total"] == 2
    assert "vllm:kv_cache_usage_perc" in m and "vllm:time_to_first_token_seconds_count" in m


def test_streaming_chat_and_errors(sim: str) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    ).encode()
    status, raw, _ = http("POST", sim + "/v1/chat/completions", body)
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert not any("usage" in c for c in chunks), "no stream_options.include_usage: no usage (vLLM)"
    assert post_json(sim + "/v1/completions", {"model": "nope", "prompt": "x"})[0] == 404
    assert http("POST", sim + "/v1/completions", b"{bad")[0] == 400
    assert post_json(sim + "/reset_prefix_cache", {})[0] == 200


def test_time_to_first_token_is_observed_at_the_first_token_as_vllm(sim: str) -> None:
    """vLLM observes ``vllm:time_to_first_token_seconds`` when a request's first token is out, not
    when it ends: mid-stream the count already holds the request, the success counter not yet."""
    host, port = sim.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=30)
    body = json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    )
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first  # the first token's event
    mid = metrics(sim)
    assert mid["vllm:time_to_first_token_seconds_count"] == 1, "observed at the first token"
    assert mid.get("vllm:request_success_total", 0) == 0, "the request is still streaming"
    rest = resp.read()
    conn.close()
    assert rest.rstrip().endswith(b"data: [DONE]")
    end = metrics(sim)
    assert end["vllm:time_to_first_token_seconds_count"] == 1 and end["vllm:request_success_total"] == 1


def _stream(url: str, doc: dict[str, object]) -> list[dict[str, Any]]:
    status, raw, _ = http("POST", url, json.dumps(doc).encode())
    assert status == 200, raw
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_usage_follows_stream_options_as_vllm(sim: str) -> None:
    url = sim + "/v1/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    plain = _stream(url, body)
    assert len(plain) == 3 and all(c["choices"] and "usage" not in c for c in plain)
    assert len(_stream(url, {**body, "stream_options": {"include_usage": False}})) == 3
    final = _stream(url, {**body, "stream_options": {"include_usage": True}})
    assert [len(c["choices"]) for c in final] == [1, 1, 1, 0], "one usage chunk, last, with no choices"
    assert all("usage" not in c for c in final[:-1])
    usage = final[-1]["usage"]
    assert usage["prompt_tokens"] == 145 and usage["completion_tokens"] == 3 and usage["total_tokens"] == 148
    assert usage["prompt_tokens_details"]["cached_tokens"] == 144, "the earlier streams cached the prompt"
    running = _stream(
        url, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )
    assert [c["usage"]["completion_tokens"] for c in running] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 145 for c in running)
    alone = _stream(url, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in alone), "continuous usage needs include_usage (vLLM)"
    status, err = post_json(url, {**body, "stream": False, "stream_options": {"include_usage": True}})
    assert status == 400 and "Stream options can only be defined when `stream=True`." in str(err)


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize(
    "opts",
    [
        None,
        {},
        {"include_usage": False},
        {"include_usage": True},
        {"include_usage": None},
        {"continuous_usage_stats": True},
        {"include_usage": True, "continuous_usage_stats": True},
    ],
)
def test_usage_options_equal_vllm_should_include_usage(
    opts: dict[str, bool | None] | None, force: bool
) -> None:
    """The simulator's decision is vLLM's own ``should_include_usage`` on the same options."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.generate.base.protocol import StreamOptions
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage

    from replica.sim.server import Api

    api = Api(None, MODEL, (), None, force_include_usage=force)  # type: ignore[arg-type]
    doc: dict[str, Any] = {"stream": True} if opts is None else {"stream": True, "stream_options": opts}
    want = should_include_usage(None if opts is None else StreamOptions(**opts), force)
    assert api.usage_options(doc) == want


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, process group), from /proc."""
    out = {}
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            out[int(d.name)] = (int(fields[1]), int(fields[2]))
    return out


def _descendants(pid: int) -> dict[int, int]:
    """Every live descendant of ``pid``: pid -> its process group."""
    table, found, frontier = _proc_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, pgid) in table.items():
            if ppid == parent and child not in found:
                found[child] = pgid
                frontier.append(child)
    return found


def _child_groups(pid: int, want: int, timeout: float = 30.0) -> dict[int, int]:
    """The stack's children in their own process groups (session leaders), once ``want`` exist."""
    deadline = time.monotonic() + timeout
    while True:
        groups = {p: g for p, g in _descendants(pid).items() if p == g}
        if len(groups) >= want or time.monotonic() > deadline:
            return groups
        time.sleep(0.1)


def _assert_gone(groups: dict[int, int]) -> None:
    """No process is left in any of the children's process groups (nothing orphaned)."""
    left = []
    for pgid in groups.values():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        left.append(pgid)
    assert not left, f"process groups still alive: {left}"


def _stack_args(replicas: int) -> tuple[dict[str, int], int, list[str]]:
    ports = {k: free_port() for k in ("port", "admin-port")}
    for k in ("picker-port", "metrics-port"):  # the stack also binds port + 1 (gRPC health, debug API)
        ports[k] = free_port()
        while not _closed(ports[k] + 1) or ports[k] + 1 in ports.values():
            ports[k] = free_port()
    base = free_port()
    while not all(_closed(base + i) for i in range(1, replicas)):
        base = free_port()
    args = [f"--{k}={v}" for k, v in ports.items()] + [f"--base-port={base}", "--once"]
    return ports, base, args


@pytest.mark.envoy
def test_make_run_serves_through_envoy_and_stops_cleanly() -> None:
    ports, base, args = _stack_args(2)
    args.append("--sim-args='--profile cpu-test'")
    proc = subprocess.Popen(
        ["make", "-s", "run", "REPLICAS=2", f"RUN_ARGS={' '.join(args)}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    groups: dict[int, int] = {}
    head = b""
    try:
        # The banner is the stack's "ready" (it prints after every port is open); a request can
        # succeed through Envoy before that, and a Ctrl-C then would read as one during startup.
        head = _read_until(proc, b"Ctrl-C stops everything", 90)
        groups = _child_groups(proc.pid, 4)
        assert len(groups) == 4, f"2 replicas, the picker and Envoy, each in its own group: {groups}"
        deadline = time.monotonic() + 30
        while (
            res := post_json(
                f"http://127.0.0.1:{ports['port']}/v1/completions",
                {"model": MODEL, "prompt": "hello", "max_tokens": 2},
            )
        )[0] != 200:
            assert time.monotonic() < deadline, res
            time.sleep(0.3)
        assert res[1]["usage"]["completion_tokens"] == 2
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already when startup failed
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals make's whole group
        out, _ = proc.communicate(timeout=30)
    text = (head + out).decode()
    # Ctrl-C reaches make too, which then reports the interrupt itself; the stack must have stopped.
    assert proc.returncode in (0, -signal.SIGINT, 2, 130), text
    assert "curl -s http://127.0.0.1:" in text and "stopped" in text
    assert "Traceback" not in text, text
    _assert_gone(groups)
    for port in [*ports.values(), base, base + 1]:
        assert _closed(port), f"port {port} still open after Ctrl-C"


@pytest.mark.envoy
def test_stack_stops_its_children_on_sighup() -> None:
    """Closing the terminal sends SIGHUP to the stack only (the children have their own
    sessions); it must stop them as Ctrl-C does rather than die and orphan them."""
    ports, base, args = _stack_args(1)
    proc = subprocess.Popen(
        [PY, "-m", "kvlaunch.run", "--replicas=1", "--sim-args=--profile cpu-test", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        head = _read_until(proc, b"stack is up", 90)
        groups = _child_groups(proc.pid, 3)
        assert len(groups) == 3, groups
        proc.send_signal(signal.SIGHUP)
        out, _ = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = (head + out).decode()
    assert proc.returncode == 0, text
    assert "SIGHUP: stopping" in text and "stopped" in text and "Traceback" not in text, text
    _assert_gone(groups)
    for port in [*ports.values(), base]:
        assert _closed(port), f"port {port} still open after SIGHUP"


@pytest.mark.envoy
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_startup_stops_promptly_without_traceback(sig: signal.Signals) -> None:
    """The replicas bind 127.0.0.2, so the stack waits for 127.0.0.1 in vain (60 s); a signal
    then must stop it within seconds, with no traceback, killing what was started."""
    _, base, args = _stack_args(2)
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "kvlaunch.run",
            "--replicas=2",
            "--sim-args=--profile cpu-test --host 127.0.0.2",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _open(("127.0.0.2", base)):
            assert proc.poll() is None and time.monotonic() < deadline, "the replica never bound"
            time.sleep(0.1)
        groups = _child_groups(proc.pid, 4)
        os.killpg(proc.pid, sig)  # as a terminal does: the stack's group, not the children's
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode()
    assert proc.returncode == 0 and took < 12, (took, text)
    assert f"{sig.name} during startup: stopping" in text, text
    assert "Traceback" not in text and "stack is up" not in text, text
    _assert_gone(groups)


def test_sim_args_are_checked_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlaunch import run as stack

    with pytest.raises(SystemExit) as e:
        stack.parse_args(["--sim-args", "--profile h100-llama3-8b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown profile 'h100-llama3-8b'" in err and "h100-llama-3.1-8b" in err
    assert stack.parse_args(["--sim-args", "--profile h100-llama-3.1-8b --time-scale 0.1"]).replicas == 4
    with pytest.raises(SystemExit):
        stack.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--profile h100-llama-3.1-8b" in out and "llama3-8b" not in out, "the help names a real profile"


def _read_until(proc: subprocess.Popen[bytes], marker: bytes, timeout: float) -> bytes:
    """The process's output up to and including ``marker`` (it keeps running)."""
    assert proc.stdout is not None
    fd, buf = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, buf.decode(errors="replace")
        if select.select([fd], [], [], min(left, 0.5))[0]:
            buf += os.read(fd, 65536)
    return buf


def _open(addr: tuple[str, int]) -> bool:
    with socket.socket() as s:
        return s.connect_ex(addr) == 0


@pytest.mark.parametrize("which", ["port", "replica"])
def test_a_port_in_use_stops_make_run_before_it_starts_anything(which: str, tmp_path: pathlib.Path) -> None:
    """A listener on one of the stack's ports (Envoy's, or a replica's on another loopback address):
    exit 1 at once, naming the port, with no banner and no child started."""
    ports, base, args = _stack_args(2)
    taken, host = (ports["port"], "127.0.0.1") if which == "port" else (base + 1, "127.0.0.3")
    with socket.socket() as holder:
        holder.bind((host, taken))
        holder.listen()
        done = subprocess.run(
            [PY, "-m", "kvlaunch.run", "--replicas=2", f"--run-dir={tmp_path}", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {taken} is in use" in done.stderr, done.stderr
    assert "stack is up" not in done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert not list(tmp_path.glob("*.log")), "a child was started"


def test_ports_the_stack_would_bind_twice_are_refused() -> None:
    from kvlaunch import run

    args = run.parse_args(["--replicas=3", "--base-port=8001", "--picker-port=8002"])
    assert run.check_ports(args) == (
        "port 8002 is both the picker ext_proc (--picker-port) and the replica 1 (--base-port + 1)"
    )
    clash = run.check_ports(run.parse_args(["--metrics-port=8079"]))
    assert (
        clash == "port 8080 is both the Envoy listener (--port) and the picker debug API (--metrics-port + 1)"
    )


@pytest.mark.envoy
def test_make_run_piped_prints_status_lines_and_envoy_listens_on_loopback(tmp_path: pathlib.Path) -> None:
    """Stdout a pipe (``make run | tee log``): a plain status line keeps coming, every
    ``--status-interval``; Envoy's listener is bound to 127.0.0.1 only; ``--request-timeout`` and
    ``--envoy-args`` reach Envoy's config."""
    ports, base, args = _stack_args(1)
    args.remove("--once")
    proc = subprocess.Popen(
        [
            *(PY, "-m", "kvlaunch.run", "--replicas=1", "--sim-args=--profile cpu-test"),
            *("--status-interval=0.3", f"--run-dir={tmp_path}", *args),
            *("--request-timeout=7s", "--envoy-args=--max-connections 999"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _read_until(proc, b"Ctrl-C stops everything", 90)
        post_json(f"http://127.0.0.1:{ports['port']}/v1/completions", {"model": MODEL, "prompt": "hi"})
        out = _read_until(proc, b"req 1 hit", 30)  # the request shows up in a later line
        out += _read_until(proc, f"] :{base} req 1 ".encode(), 10)
        lines = [ln for ln in out.decode().splitlines() if ln.startswith("[")]
        assert len(lines) >= 2 and "\x1b" not in out.decode(), out
        assert _open(("127.0.0.1", ports["port"])) and not _open(("127.0.0.2", ports["port"]))
        config = (tmp_path / "envoy.yaml").read_text()  # the slow-client limits reach make run's Envoy
        assert "request_timeout: 7s" in config and "max_active_downstream_connections: 999" in config
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and b"stopped" in rest, rest
