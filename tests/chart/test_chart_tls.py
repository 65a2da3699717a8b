"""mTLS between the gateway and the pickers: the chart's CA (Helm-generated or cert-manager), the
pickers requiring a client certificate, and the gateway's side (the Secret for a plain Envoy,
Istio's DestinationRule); and the generated certificates working with a real picker and Envoy."""

from __future__ import annotations

import base64
import json
import pathlib
import subprocess
from typing import Any

import grpc
import helm_python
import pytest
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvlaunch import Procs, Stack, free_port, post_json
from picker.__main__ import build_parser
from tests.chart.test_chart import CHART, NS, RELEASE, VALUE_SETS, one, render, validate

pytestmark = pytest.mark.chart
PICKER_SECRET, CLIENT_SECRET = f"{RELEASE}-picker-tls", f"{RELEASE}-gateway-client-tls"


def picker_args(docs: list[dict[str, Any]]) -> Any:
    c = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]["containers"][0]
    return build_parser().parse_args(c["args"])


def secret_files(docs: list[dict[str, Any]], name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in one(docs, "Secret", name)["data"].items()}


def test_defaults_require_the_gateway_certificate() -> None:
    """Provider none (a gateway you run): the pickers require a client certificate from the
    chart's CA, mount their own Secret, and the gateway's Secret is signed by the same CA."""
    docs = render({})
    for d in docs:
        validate(d)
    args = picker_args(docs)
    assert (args.cert_path, args.client_ca_path) == ("/etc/kvpick-tls", "/etc/kvpick-tls/ca.crt")
    assert args.secure_serving and args.enable_cert_reload
    pod = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": PICKER_SECRET}} in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls")
    assert mount == {"name": "tls", "mountPath": "/etc/kvpick-tls", "readOnly": True}
    server, client = secret_files(docs, PICKER_SECRET), secret_files(docs, CLIENT_SECRET)
    assert set(server) == set(client) == {"tls.crt", "tls.key", "ca.crt"}
    assert server["ca.crt"] == client["ca.crt"], "one CA signs both"
    ca = x509.load_pem_x509_certificate(server["ca.crt"])
    for pem in (server["tls.crt"], client["tls.crt"]):
        x509.load_pem_x509_certificate(pem).verify_directly_issued_by(ca)
    names = x509.load_pem_x509_certificate(server["tls.crt"]).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert f"{RELEASE}-picker.{NS}.svc.cluster.local" in names.value.get_values_for_type(x509.DNSName)
    probes = [pod["containers"][0][p]["grpc"]["port"] for p in ("livenessProbe", "readinessProbe")]
    assert probes == [9003, 9003], "the kubelet probes the plaintext health port, not ext_proc"
    assert (
        "mTLS"
        in helm_python.Chart.load(str(CHART)).render(values={}, name=RELEASE, namespace=NS)[
            "kvpick/templates/NOTES.txt"
        ]
    )


@pytest.mark.parametrize("provider", ["envoy-gateway", "kgateway", "istio", "gke"])
def test_auto_is_off_where_the_chart_cannot_give_the_gateway_a_certificate(provider: str) -> None:
    docs = render(VALUE_SETS[provider])
    assert picker_args(docs).client_ca_path is None
    assert not [d for d in docs if d["kind"] == "Secret"]
    on = render({**VALUE_SETS[provider], "tls": {"clientAuth": True}})
    assert picker_args(on).client_ca_path == "/etc/kvpick-tls/ca.crt"
    assert {d["metadata"]["name"] for d in on if d["kind"] == "Secret"} == {PICKER_SECRET, CLIENT_SECRET}


def test_istio_presents_the_client_certificate() -> None:
    dr = one(render(VALUE_SETS["istio-mtls"]), "DestinationRule")
    assert dr["spec"]["trafficPolicy"]["tls"] == {"mode": "MUTUAL", "credentialName": CLIENT_SECRET}


def test_off_and_refused() -> None:
    off = render({"tls": {"clientAuth": False}})
    assert picker_args(off).client_ca_path is None and not [d for d in off if d["kind"] == "Secret"]
    with pytest.raises(Exception, match=r"needs picker\.secureServing"):
        render({"tls": {"clientAuth": True}, "picker": {"secureServing": False}})
    with pytest.raises(Exception, match="clientAuth"):
        render({"tls": {"clientAuth": "yes"}})


def test_cert_manager_issues_both_certificates() -> None:
    docs = render(VALUE_SETS["cert-manager"])
    assert not [d for d in docs if d["kind"] == "Secret"], "cert-manager writes the Secrets"
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert certs[f"{RELEASE}-ca"]["isCA"] is True
    ca_issuer = {"name": f"{RELEASE}-ca", "kind": "Issuer", "group": "cert-manager.io"}
    assert one(docs, "Issuer", f"{RELEASE}-ca")["spec"] == {"ca": {"secretName": f"{RELEASE}-ca"}}
    server, client = certs[PICKER_SECRET], certs[CLIENT_SECRET]
    assert (server["secretName"], client["secretName"]) == (PICKER_SECRET, CLIENT_SECRET)
    assert server["issuerRef"] == client["issuerRef"] == ca_issuer
    assert "server auth" in server["usages"] and "client auth" in client["usages"]
    assert f"{RELEASE}-picker-peers.{NS}.svc.cluster.local" in server["dnsNames"]
    assert picker_args(docs).enable_cert_reload, "the picker re-reads its renewed certificate"
    own = {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    docs = render({"tls": {"certManager": {"enabled": True, "issuerRef": own}}})
    assert not [d for d in docs if d["kind"] == "Issuer"]
    assert [d["spec"]["issuerRef"] for d in docs if d["kind"] == "Certificate"] == [own, own]


def _write(docs: list[dict[str, Any]], name: str, d: pathlib.Path) -> pathlib.Path:
    d.mkdir()
    for k, v in secret_files(docs, name).items():
        (d / k).write_bytes(v)
    return d


@pytest.mark.envoy
def test_the_generated_certificates_work_with_the_picker_and_envoy(tmp_path: pathlib.Path) -> None:
    """The chart's Secrets as the pods mount them: the picker with its args, Envoy presenting the
    gateway's certificate (render.py --client-cert-dir) routes; a client without one is refused."""
    docs = render({})
    server = _write(docs, PICKER_SECRET, tmp_path / "picker-tls")
    client = _write(docs, CLIENT_SECRET, tmp_path / "gateway-tls")
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()], mtls=False)  # the chart's certificates, not the stack's own
    try:
        st.start_upstreams()
        st.start_picker("--cert-path", str(server), "--client-ca-path", str(server / "ca.crt"), debug=False)
        st.start_envoy("--client-cert-dir", str(client))
        st.wait_routable()
        status, doc = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "hi"})
        assert status == 200 and doc["served_by"] == st.upstreams[0], doc
        creds = grpc.ssl_channel_credentials(root_certificates=(server / "ca.crt").read_bytes())
        opts = (("grpc.ssl_target_name_override", f"{RELEASE}-picker"),)
        headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")])
        msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))
        with (
            grpc.secure_channel(f"127.0.0.1:{st.grpc_port}", creds, options=opts) as ch,
            pytest.raises(grpc.RpcError) as err,
        ):
            list(pb_grpc.ExternalProcessorStub(ch).Process(iter([msg]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        procs.stop()


@pytest.mark.envoy
def test_kind_envoy_mounts_the_gateway_secret(tmp_path: pathlib.Path) -> None:
    """deploy/kind: e2e.sh names the chart's client Secret; the manifest mounts it where the
    Envoy config reads the certificate, and Envoy accepts that config with the chart's files."""
    from tests.chart.test_deploy_assets import ENVOY, PICKER, envoy_manifest

    script = (CHART.parents[1] / "deploy/kind/e2e.sh").read_text()
    assert '--client-secret "$RELEASE-gateway-client-tls"' in script
    docs = envoy_manifest.manifests("kvpick", PICKER, True, "envoy", 8080, "g", CLIENT_SECRET)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "client-tls", "secret": {"secretName": CLIENT_SECRET}} in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "client-tls")
    cfg = json.loads(one(docs, "ConfigMap")["data"]["envoy.yaml"])
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvpick_picker")
    tls = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["tls_certificates"][0]["certificate_chain"]["filename"] == f"{mount['mountPath']}/tls.crt"
    assert tls["validation_context"]["trusted_ca"]["filename"] == f"{mount['mountPath']}/ca.crt"
    local = _write(render({}), CLIENT_SECRET, tmp_path / "gateway-tls")
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(envoy_manifest.envoy_config(PICKER, True, 8080, str(local))))
    proc = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
