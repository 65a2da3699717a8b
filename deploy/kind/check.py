#!/usr/bin/env python3
"""The kind test's assertions, over HTTP through the gateway (stdlib only).

1. **Prefix affinity**: groups of requests share a long prompt prefix; each group's requests
   must land on one replica (the one its first request warmed), and the groups must spread
   over more than one replica.
2. **Failover**: the replica that served group 0 is deleted (kubectl); group 0's requests must
   succeed again within the deadline, on another replica, and never on the deleted one.

Which replica served a request is read from Envoy's ``x-kvpick-upstream`` response header.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter


def send(url: str, model: str, prompt: str) -> tuple[int, str]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status, resp.headers.get("x-kvpick-upstream", "")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("x-kvpick-upstream", "")
    except (urllib.error.URLError, OSError):
        return 0, ""


def prefix(group: int) -> str:
    rng = random.Random(group)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "block", "token", "route", "pool"]
    return f"[system {group}] " + " ".join(rng.choice(words) for _ in range(600))


def affinity(url: str, model: str, groups: int, per_group: int) -> dict[int, str]:
    owner: dict[int, str] = {}
    for g in range(groups):
        hosts = []
        for i in range(per_group):
            status, host = send(url, model, f"{prefix(g)}\nQuestion {i}: why?")
            assert status == 200, f"group {g} request {i}: HTTP {status}"
            hosts.append(host)
        top, count = Counter(hosts).most_common(1)[0]
        assert count >= per_group - 1, f"group {g} was split over replicas: {hosts}"
        owner[g] = top
        print(f"affinity: group {g} -> {top} ({count}/{per_group})")
    spread = set(owner.values())
    assert len(spread) > 1, f"all {groups} groups went to one replica {spread}: no load spreading"
    return owner


def pod_at(namespace: str, host: str) -> str:
    ip = host.rsplit(":", 1)[0]
    out = subprocess.check_output(
        [
            "kubectl",
            "-n",
            namespace,
            "get",
            "pods",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{'\\n'}{end}",
        ],
        text=True,
    )
    names = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [ip]]
    assert names, f"no pod has IP {ip}"
    return names[0]


def failover(url: str, model: str, namespace: str, host: str, deadline_s: float) -> None:
    pod = pod_at(namespace, host)
    print(f"failover: deleting {pod} ({host})")
    subprocess.check_call(["kubectl", "-n", namespace, "delete", "pod", pod, "--wait=false"])
    start, streak, failures = time.monotonic(), 0, 0
    while streak < 10:
        assert time.monotonic() - start < deadline_s, f"no 10 successes in a row within {deadline_s}s"
        status, served = send(url, model, f"{prefix(0)}\nAfter failover: why?")
        if status == 200:
            assert served != host, f"a request went to the deleted replica {host}"
            streak += 1
        else:
            streak, failures = 0, failures + 1
            time.sleep(0.5)
    print(f"failover: recovered in {time.monotonic() - start:.1f}s with {failures} failed requests")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument(
        "--model", required=True, help="the served model: the chart's `model` value (e2e.sh passes both)"
    )
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--failover-deadline", type=float, default=60.0)
    return p


def main() -> int:
    args = build_parser().parse_args()
    owner = affinity(args.url, args.model, args.groups, args.per_group)
    failover(args.url, args.model, args.namespace, owner[0], args.failover_deadline)
    print("PASS: prefix affinity and failover")
    return 0


if __name__ == "__main__":
    sys.exit(main())
