"""kvpick's own gRPC API: generated code is fresh, and Explain answers over the TLS ext_proc port."""

from __future__ import annotations

import json
import pathlib

import grpc
import pytest

from kvlaunch import ROOT, Stack, post_json, stack
from picker._proto.kvpick.v1 import explain_pb2, explain_pb2_grpc


def test_generated_code_is_fresh(tmp_path: pathlib.Path) -> None:
    from proto.__main__ import generate

    fresh = generate(tmp_path)
    assert fresh, "no .proto files compiled"
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed: run `python -m proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} is stale: run `python -m proto`"


@pytest.mark.envoy
def test_grpc_explain_matches_http_explain(tmp_path: pathlib.Path) -> None:
    with stack(tmp_path, picker_args=("--enable-explain-grpc",)) as envoy_stack:
        _explain_both_ways(envoy_stack)


def _explain_both_ways(envoy_stack: Stack) -> None:
    doc = {"model": "m", "prompt": "An explainable prompt that spans a few blocks of text. " * 8}
    post_json(envoy_stack.url + "/v1/completions", doc)
    creds = envoy_stack.grpc_credentials()
    opts = (("grpc.ssl_target_name_override", "kvpick-picker"),)
    with grpc.secure_channel(f"127.0.0.1:{envoy_stack.grpc_port}", creds, options=opts) as ch:
        stub = explain_pb2_grpc.ExplainStub(ch)
        resp = stub.Explain(
            explain_pb2.ExplainRequest(path="/v1/completions", body=json.dumps(doc).encode()), timeout=10
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Explain(explain_pb2.ExplainRequest(body=b"{not json"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    url = f"http://127.0.0.1:{envoy_stack.debug_port}/debug/explain"
    status, http_doc = post_json(url, doc, envoy_stack.debug_headers)
    assert status == 200
    assert list(resp.chosen) == http_doc["chosen"]
    by_key = {e.endpoint: e for e in resp.endpoints}
    for key, e in http_doc["endpoints"].items():
        assert by_key[key].matched_blocks == e["matched_blocks"]
        assert by_key[key].model.prefill_source == e["model"]["prefill_source"]
        assert by_key[key].model.prefill_tokens_per_s == e["model"]["prefill_tokens_per_s"] > 0
    assert max(e.matched_blocks for e in resp.endpoints) > 0
