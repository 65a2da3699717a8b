"""Bad input gets a clear 4xx through Envoy, and the picker keeps serving; good bodies arrive intact."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvlaunch import Stack, http

pytestmark = pytest.mark.envoy


def send(st: Stack, body: bytes) -> tuple[int, dict[str, object]]:
    status, raw, _ = http("POST", st.url + "/v1/completions", body, {"content-type": "application/json"})
    return status, json.loads(raw)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"model": "m", "prompt": ', 400, "not valid JSON"),
        (b'{"prompt": "no model here"}', 400, "model"),
        (b'{"model": "m", "prompt": "\xff\xfe bad utf-8"}', 400, "not valid JSON"),
        (b"[1, 2, 3]", 400, "JSON object"),
        (b'{"model": "m", "prompt": ' + b"[" * 200 + b"]" * 200 + b"}", 400, "nested"),
    ],
    ids=["malformed", "missing-model", "invalid-utf8", "not-object", "deep-nesting"],
)
def test_bad_input_gets_4xx_with_message(envoy_stack: Stack, body: bytes, status: int, needle: str) -> None:
    got, doc = send(envoy_stack, body)
    assert got == status, doc
    err = doc["error"]
    assert isinstance(err, dict) and needle in str(err["message"])
    ok, _ = send(envoy_stack, b'{"model": "m", "prompt": "still serving"}')
    assert ok == 200


def test_oversize_body_gets_413_and_picker_keeps_serving(envoy_stack: Stack) -> None:
    big = b'{"model": "m", "prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    got, doc = send(envoy_stack, big)
    assert got == 413, doc
    assert "exceeds" in str(doc["error"])
    assert send(envoy_stack, b'{"model": "m", "prompt": "after"}')[0] == 200
    envoy_stack.wait_in_flight_zero()


def test_one_megabyte_body_arrives_byte_identical(envoy_stack: Stack) -> None:
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog ünïcødé\n" for i in range(16_000))
    body = json.dumps({"model": "m", "prompt": text[: 1024 * 1024]}, ensure_ascii=False).encode()
    assert len(body) > 1_000_000
    got, doc = send(envoy_stack, body)
    assert got == 200
    assert doc["bytes"] == len(body)
    assert doc["sha256"] == hashlib.sha256(body).hexdigest()


def test_large_bodies_parsed_off_the_loop_route_and_fail_cleanly(envoy_stack: Stack) -> None:
    """Bodies over parse_offload_bytes (512 KiB) are parsed in the worker process: a 3 MiB chat
    request with a base64 image arrives byte-identical, and a malformed 1 MiB body is a 400."""
    import base64
    import os

    url = "data:image/png;base64," + base64.b64encode(os.urandom(3 * 1024 * 1024 * 3 // 4)).decode()
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}).encode()
    got, doc = send(envoy_stack, body)
    assert got == 200 and doc["sha256"] == hashlib.sha256(body).hexdigest()
    got, doc = send(envoy_stack, b'{"model": "m", "prompt": "' + b"x" * (1 << 20))
    assert got == 400 and "not valid JSON" in str(doc["error"])
    eps = envoy_stack.wait_in_flight_zero()
    assert all(e["pending_prefill_tokens"] == 0 for e in eps.values())
