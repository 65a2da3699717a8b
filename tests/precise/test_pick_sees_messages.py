"""A pick sees every KV event and peer message that reached the picker before it
(``picker.feeds.drain``'s invariant), through real processes: two simulator replicas publishing KV
events, one picker behind a real Envoy, and this test posing as a peer picker on a ZMQ PUB socket.

The picker runs with ``--message-interval 30``: its inbox's timer does not fire during the test,
so only the read before each pick can bring a message in. Each check could only pass by chance
without it: the replicas hold prompts the picker never routed, the peer claims prompts neither
replica holds, and the expected endpoint alternates.

- KV events: a prompt is sent straight to one replica (bypassing the picker), then, 0.3 s later,
  a follow-up through Envoy must go to that replica, the picker must have found every block of
  the prompt there (its hit-ratio histogram), and the replica must report them cached;
- peer picks: the peer announces a pick of a new prompt on one replica, then, 0.3 s later, a
  follow-up through Envoy must go there, every block found (the peer's pick is a speculative
  entry);
- the picker's ``kvpick_message_reads_total`` counts a read before each pick and none on its timer.
"""

from __future__ import annotations

import json
import pathlib
import time

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvlaunch import Procs, Stack, free_port, http
from picker.core.prefix.precise import request_keys
from tests.precise.test_picker_precise import HOSTS, MODEL, complete, start_sim, wait_for

pytestmark = [pytest.mark.precise, pytest.mark.envoy, pytest.mark.timeout(240)]
BS = 16
SETTLE_S = 0.3
"""Between a message and the pick that must see it: long enough for loopback delivery, far
shorter than the picker's timer."""


def direct(host: str, port: int, prompt: list[int]) -> None:
    status, body, _ = http(
        "POST",
        f"http://{host}:{port}/v1/completions",
        json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 200, body


def served(ports: list[int]) -> list[float]:
    """Requests each replica has finished (its ``vllm:request_success_total`` counters)."""
    out = []
    for host, port in zip(HOSTS, ports, strict=True):
        status, body, _ = http("GET", f"http://{host}:{port}/metrics")
        assert status == 200, body
        lines = body.decode().splitlines()
        out.append(
            sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:request_success_total"))
        )
    return out


def samples(st: Stack, name: str) -> list[Sample]:
    _, body, _ = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples if s.name == name]


def hit_ratio_sum(st: Stack) -> float:
    """The picker's sum of its picks' prefix hit ratios (blocks found on the chosen endpoint)."""
    _, body, _ = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")
    line = next(
        x
        for x in body.decode().splitlines()
        if x.startswith("inference_extension_prefix_indexer_hit_ratio_sum")
    )
    return float(line.rsplit(" ", 1)[1])


def through_envoy(st: Stack, ports: list[int], prompt: list[int]) -> tuple[int, int, float]:
    """(index of the replica that served ``prompt`` through Envoy, its cached tokens, the share
    of the prompt's blocks the picker found on the endpoint it chose)."""
    before, hits = served(ports), hit_ratio_sum(st)
    _, cached = complete(st, prompt)
    deadline = time.monotonic() + 5
    while (after := served(ports)) == before:
        assert time.monotonic() < deadline, "no replica counted the request"
        time.sleep(0.05)
    grew = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
    assert len(grew) == 1, (before, after)
    return grew[0], cached, round(hit_ratio_sum(st) - hits, 3)


def test_a_pick_sees_what_arrived_before_it(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    ports, ev = [free_port(), free_port()], free_port()
    st = Stack(procs, ports)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.PUB)
    peer.setsockopt(zmq.LINGER, 0)
    peer_url = f"tcp://127.0.0.1:{free_port()}"
    peer.bind(peer_url)
    try:
        for host, port in zip(HOSTS, ports, strict=True):
            start_sim(procs, host, port, ev)
        eps = [f"{h}:{p}" for h, p in zip(HOSTS, ports, strict=True)]
        st.start_picker(
            "--endpoints", ",".join(eps), "--prefix-mode", "precise", "--kv-events-port", str(ev),
            "--peer-bind", f"tcp://127.0.0.1:{free_port()}", "--peers", peer_url, "--message-interval", "30",
        )  # fmt: skip
        st.start_envoy()
        wait_for(lambda: all(e["health"] == "ready" for e in st.endpoints().values()), "endpoints ready")
        complete(st, [5, *range(20, 20 + 4 * BS)])  # a first pick: the block size is learned
        time.sleep(1.0)  # our PUB socket has the picker's subscription

        for i in range(4):  # KV events of prompts the picker never routed
            which = i % 2
            doc = [7, i, *range(1000 * (i + 1), 1000 * (i + 1) + 12 * BS - 2)]  # 12 blocks
            direct(HOSTS[which], ports[which], [*doc, 1])
            time.sleep(SETTLE_S)
            got = through_envoy(st, ports, [*doc, 2, 3])
            assert got == (which, 12 * BS, 1.0), (i, got, st.endpoints())

        for i in range(4):  # a peer's picks of prompts no replica holds
            which = i % 2
            doc = [9, i, *range(50_000 * (i + 1), 50_000 * (i + 1) + 12 * BS - 2)]
            keys = request_keys(doc, BS)
            assert len(keys) == 12
            peer.send_multipart(
                [b"pick", msgpack.packb(["test-peer", eps[which], keys, []], use_bin_type=True)]
            )
            time.sleep(SETTLE_S)
            got = through_envoy(st, ports, [*doc, 2, 3])
            assert got == (which, 0, 1.0), (i, got, st.endpoints())
        reads = {s.labels["trigger"]: s.value for s in samples(st, "kvpick_message_reads_total")}
        assert reads["pick"] >= 9 and reads["timer"] == 0, reads
    finally:
        peer.close()
        ctx.term()
        procs.stop()
