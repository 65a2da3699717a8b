"""``bench.keepalive``'s two pieces that decide its verdict, on fixed inputs: the old setting's
Envoy config differs from the shipped one only in the model-server clusters' idle timeout (plus
the bench's access-log fields), and a request is matched to the server's keep-alive close of its
connection by Envoy's and the server's own records."""

from __future__ import annotations

import json
import pathlib
import subprocess

import yaml

from bench import keepalive
from kvlaunch import PY, ROOT

RENDER = str(ROOT / "deploy/envoy/render.py")


def _clusters(text: str) -> dict[str, dict[str, object]]:
    return {c["name"]: c for c in yaml.safe_load(text)["static_resources"]["clusters"]}


def test_the_old_setting_changes_only_the_model_server_idle_timeout(tmp_path: pathlib.Path) -> None:
    log = str(tmp_path / "access.jsonl")
    args = ["--upstream", "pool", "--endpoints", "127.0.0.1:8001", "--access-log", log, "-o", "-"]
    text = subprocess.run([PY, RENDER, *args], check=True, capture_output=True, text=True).stdout
    shipped, shipped_idle = keepalive.envoy_config(text, None, log)
    old, old_idle = keepalive.envoy_config(text, keepalive.OLD_IDLE, log)
    assert old_idle == "60s"
    assert shipped_idle.endswith("s") and float(shipped_idle[:-1]) < keepalive.KEEP_ALIVE_S
    a, b = _clusters(shipped), _clusters(old)
    assert a.keys() == b.keys()
    for name in a:
        if name == "kvpick_upstream":
            opts = "typed_extension_protocol_options"
            key = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
            assert b[name][opts][key]["common_http_protocol_options"]["idle_timeout"] == "60s"  # type: ignore[index]
            b[name][opts][key]["common_http_protocol_options"]["idle_timeout"] = shipped_idle  # type: ignore[index]
        assert a[name] == b[name], name
    assert '"%UPSTREAM_CONNECTION_ID%"' in json.dumps(yaml.safe_load(old))


def _line(rid: str, start: float, cx: int, port: int, tx_us: int, end_us: int | None, status: int) -> str:
    return json.dumps(
        {
            "id": rid,
            "start": f"{start:.6f}",
            "status": status,
            "flags": "-" if status == 200 else "UC",
            "details": "via_upstream" if status == 200 else "upstream_reset_before_response_started{x}",
            "cx": cx,
            "upstream_local": f"127.0.0.1:{port}",
            "upstream_tx_us": tx_us,
            "upstream_rx_end_us": "-" if end_us is None else end_us,
        }
    )


def test_a_reuse_is_matched_to_the_servers_close_of_its_connection(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "access.jsonl"
    log.write_text(
        "\n".join(
            [
                _line("60s-0-0", 100.0, 7, 40001, 1_000, 10_000, 200),  # ends at 100.010
                _line("60s-0-1", 100.0, 8, 40002, 2_000, 11_000, 200),  # ends at 100.011
                _line("60s-0-2", 100.0, 9, 40003, 2_000, 11_000, 200),  # ends at 100.011
                _line("60s-1-0", 105.0, 7, 40001, 10_800, None, 503),  # written at 105.0108
                _line("60s-1-1", 105.0, 8, 40002, 5_000, 9_000, 200),  # written at 105.005
                _line("60s-1-2", 105.0, 10, 40004, 5_000, 9_000, 200),  # a new connection
                _line("x-y-z-w", 105.0, 9, 40003, 5_000, 9_000, 200),  # not the bench's: left out
            ]
        )
    )
    rs, connections, bad = keepalive.reuses(log)
    assert [r.id for r in rs] == ["60s-1-1", "60s-1-0"]
    assert connections == 4
    assert [x["id"] for x in bad] == ["60s-1-0"]
    by_id = {r.id: r for r in rs}
    assert abs(by_id["60s-1-0"].idle_s - 5.0008) < 1e-6
    closes = {40001: [105.0105], 40002: [110.1]}  # 40002 closed only 5 s after its next response
    assert abs(keepalive.after_close(by_id["60s-1-0"], closes) - 0.0003) < 1e-6  # type: ignore[operator]
    assert keepalive.after_close(by_id["60s-1-1"], closes) is None


def test_the_server_log_gives_each_close_and_how_late_the_timer_fired(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keepalive.jsonl"
    events = [("armed", 10.0, 1), ("armed", 10.5, 2), ("closed", 15.002, 1)]
    path.write_text("\n".join(json.dumps({"event": e, "t": t, "peer": p}) for e, t, p in events))
    closes, late = keepalive.server_closes(path)
    assert closes == {1: [15.002]}
    assert len(late) == 1 and abs(late[0] - 0.002) < 1e-9
