"""Only the gateway talks to the picker: mTLS on the ext_proc port, a bearer token on the debug
API (and, when asked for, on /metrics). Real parts over loopback: the picker, Envoy with the
rendered config presenting the gateway's client certificate, fake model servers."""

from __future__ import annotations

import json
import pathlib
import subprocess

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvlaunch import PY, Stack, http, post_json, stack
from picker.serving.server import EXTPROC_SERVICE
from picker.serving.tls import CA, CERT, KEY, local_pki

pytestmark = pytest.mark.envoy
TARGET = (("grpc.ssl_target_name_override", "kvpick-picker"),)


def _creds(ca: pathlib.Path, client: pathlib.Path | None) -> grpc.ChannelCredentials:
    """Trusting the picker's CA; presenting ``client``'s certificate, or none."""
    pair = {}
    if client is not None:
        pair = {"private_key": (client / KEY).read_bytes(), "certificate_chain": (client / CERT).read_bytes()}
    return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes(), **pair)


def _route(st: Stack, client: pathlib.Path | None) -> pb.ProcessingResponse:
    """One ext_proc exchange straight to the picker, as a pod bypassing the gateway would: the
    request headers and a BUFFERED body, whose answer names the destination."""
    assert st.pki is not None
    body = json.dumps({"model": "m", "prompt": "which replica holds this prefix?"}).encode()
    hdrs = [(":path", "/v1/completions"), (":method", "POST"), ("content-type", "application/json")]
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hdrs])
    msgs = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.secure_channel(f"127.0.0.1:{st.grpc_port}", _creds(st.pki.ca, client), options=TARGET) as ch:
        answers = list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=10))
    return answers[-1]


def test_ext_proc_takes_only_the_gateway_certificate(tmp_path: pathlib.Path) -> None:
    """A direct ext_proc connection without a client certificate, or with one another CA signed,
    is refused at the handshake; the gateway's certificate gets a routing answer (the control),
    and so does Envoy presenting it (the rendered config). Health stays plaintext on its port."""
    other = local_pki(tmp_path / "other-ca")
    with stack(tmp_path) as st:
        assert st.pki is not None
        assert "--client-cert-dir" in st.client_cert_args
        for client in (None, other.gateway):
            with pytest.raises(grpc.RpcError) as err:
                _route(st, client)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (client, err.value)
        answer = _route(st, st.pki.gateway)
        assert answer.WhichOneof("response") == "request_body", answer
        status, doc = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "through Envoy"})
        assert status == 200 and doc["served_by"] in st.upstreams, doc
        with grpc.insecure_channel(f"127.0.0.1:{st.health_port}") as ch:  # what the kubelet probes
            got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.secure_channel(  # Envoy's active health check of the ext_proc port, with the cert
            f"127.0.0.1:{st.grpc_port}", _creds(st.pki.ca, st.pki.gateway), options=TARGET
        ) as ch:
            req = health_pb2.HealthCheckRequest(service=EXTPROC_SERVICE)
            assert (
                health_pb2_grpc.HealthStub(ch).Check(req, timeout=10).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        assert "Traceback" not in st.procs.log("picker")


def test_debug_api_and_metrics_need_their_tokens(tmp_path: pathlib.Path) -> None:
    """The debug API answers 401 without a token or with a wrong one, 200 with the right one;
    with --metrics-token-file /metrics does the same. Every 401 is the picker's JSON error."""
    token = tmp_path / "metrics-token"
    token.write_text("metrics-secret\n")
    with stack(tmp_path, picker_args=("--metrics-token-file", str(token))) as st:
        url = f"http://127.0.0.1:{st.debug_port}/debug/explain?path=/v1/completions"
        doc = json.dumps({"model": "m", "prompt": "x"}).encode()
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": st.debug_token}):
            status, body, hdrs = http("POST", url, doc, headers)
            assert status == 401, (headers, status)
            assert json.loads(body)["error"]["type"] == "unauthorized"
            assert hdrs.get("WWW-Authenticate") == "Bearer"
        status, body, _ = http("POST", url, doc, st.debug_headers)
        assert status == 200 and json.loads(body)["endpoints"], body
        metrics = f"http://127.0.0.1:{st.metrics_port}/metrics"
        assert http("GET", metrics)[0] == 401
        assert http("GET", metrics, headers={"authorization": "Bearer metrics-secre"})[0] == 401
        status, body, _ = http("GET", metrics, headers={"authorization": "Bearer metrics-secret"})
        assert status == 200 and b"inference_pool" in body


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--enable-debug-api"], "--enable-debug-api needs --debug-token-file"),
        (
            ["--secure-serving", "false", "--client-ca-path", "ca.crt"],
            "--client-ca-path needs --secure-serving",
        ),
        (["--client-ca-path", "/nonexistent/ca.crt"], "no such file"),
    ],
)
def test_refused_configurations(args: list[str], message: str, tmp_path: pathlib.Path) -> None:
    """A debug API without a token, or mTLS without TLS or without its CA, is a bad configuration
    (exit 2), never a picker that silently serves open."""
    (tmp_path / "ca.crt").write_bytes((local_pki(tmp_path / "pki").picker / CA).read_bytes())
    done = subprocess.run(
        [PY, "-m", "picker", "--endpoints", "127.0.0.1:1", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        env={"PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
