"""The label attack (issue 23 item 2): how much client-chosen model names grow the picker's
``/metrics``. Through a real Envoy and the picker with two fake replicas (which serve model ``m``):
``/metrics`` bytes after three ordinary requests, then after nine requests whose model names are
1 MiB each and three NUL-laden ones; how many NUL bytes and the longest line it then holds.

    python bench/reliability/labels.py                               # this tree
    PYTHONPATH=/tmp/kvpick-before python bench/reliability/labels.py  # another tree's picker

Prints one JSON line. ``python -m bench.reliability labels --before-tree PATH`` runs both.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any

NAMES = [f"{i}" + "x" * (1 << 20) for i in range(9)] + ["evil\x00name\x00" * 1000, "\x00", "m\x00"]
"""Nine distinct 1 MiB names, a 10 KB one full of NULs, a lone NUL, a served name with a NUL."""


def measure() -> dict[str, Any]:
    from kvlaunch import http, post_json, stack

    def metrics(port: int) -> bytes:
        status, body, _ = http("GET", f"http://127.0.0.1:{port}/metrics")
        assert status == 200, status
        return body

    with tempfile.TemporaryDirectory() as tmp, stack(pathlib.Path(tmp)) as st:
        for _ in range(3):
            assert post_json(st.url + "/v1/completions", {"model": "m", "prompt": "p"})[0] == 200
        before = metrics(st.metrics_port)
        statuses = [post_json(st.url + "/v1/completions", {"model": n, "prompt": "p"})[0] for n in NAMES]
        st.wait_in_flight_zero()
        after = metrics(st.metrics_port)
    return {
        "requests": len(NAMES),
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "metrics_bytes_before": len(before),
        "metrics_bytes_after": len(after),
        "growth_bytes": len(after) - len(before),
        "nul_bytes_after": after.count(b"\x00"),
        "longest_line_after": max(len(line) for line in after.splitlines()),
    }


if __name__ == "__main__":
    print(json.dumps(measure()))
