"""TLS for the ext_proc port, as GIE's EPP does it: a self-signed certificate generated at start,
unless ``--cert-path DIR`` holds ``tls.crt`` and ``tls.key``; ALPN h2 comes from gRPC itself.

mTLS: with ``--client-ca-path FILE`` (a PEM bundle, e.g. the ``ca.crt`` of a cert-manager or
Helm-generated Secret) every ext_proc client must present a certificate that chains to it. A
client with none, or with one from another CA, fails the handshake: it never opens a stream.
Health probes are unaffected: they use the plaintext ``--grpc-health-port``.

:func:`local_pki` makes a throwaway CA, a picker (server) and a gateway (client) certificate, for
local stacks and tests (``kvlaunch.Stack``); a cluster gets them from the chart.
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"
"""File names in a certificate directory: a Kubernetes TLS Secret's keys (cert-manager's too)."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def _builder(
    subject: str, issuer: str, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def self_signed(hostname: str = "kvpick-picker") -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a one-year self-signed certificate (PEM key, PEM cert)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(hostname, hostname, key.public_key(), 365)
        .add_extension(_san([hostname, "localhost", "127.0.0.1"]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class LocalPki:
    """Where :func:`local_pki` wrote its certificates: each directory holds ``tls.crt``,
    ``tls.key`` and the CA's ``ca.crt`` (a Kubernetes TLS Secret's layout)."""

    picker: pathlib.Path
    """The picker's: ``--cert-path`` here, ``--client-ca-path`` its ``ca.crt``."""
    gateway: pathlib.Path
    """Envoy's client certificate (``render.py --client-cert-dir``)."""

    @property
    def ca(self) -> pathlib.Path:
        return self.picker / CA


def local_pki(root: pathlib.Path, days: int = 2, ca_name: str = "kvpick-local-ca") -> LocalPki:
    """A throwaway CA and two certificates it signs, written under ``root``: ``picker/`` (server
    auth, for ``localhost`` and ``127.0.0.1``) and ``gateway/`` (client auth). The CA's key is
    not kept: nothing can be signed by it after this returns."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    out = LocalPki(root / "picker", root / "gateway")
    for d, name, usage in (
        (out.picker, "kvpick-picker", ExtendedKeyUsageOID.SERVER_AUTH),
        (out.gateway, "kvpick-gateway", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(name, ca_name, key.public_key(), days)
            .add_extension(_san([name, "localhost", "127.0.0.1"]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        d.mkdir(parents=True, exist_ok=True)
        (d / CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / KEY).write_bytes(_key_pem(key))
        (d / KEY).chmod(0o600)
        (d / CA).write_bytes(ca_pem)
    return out


def load_or_generate(cert_dir: str | None) -> tuple[bytes, bytes]:
    if cert_dir:
        d = pathlib.Path(cert_dir)
        return (d / KEY).read_bytes(), (d / CERT).read_bytes()
    return self_signed()


def server_credentials(
    cert_dir: str | None, reload: bool = False, client_ca: str | None = None
) -> grpc.ServerCredentials:
    """Server credentials; with ``reload`` the files in ``cert_dir`` (and ``client_ca``) are
    re-read on a handshake after they changed (gRPC's dynamic credentials), like GIE's
    ``--enable-cert-reload``. With ``client_ca`` (a PEM bundle path) a client certificate that
    chains to it is required (mTLS; module doc)."""
    mtls = bool(client_ca)
    if not (cert_dir and reload):
        key, cert = load_or_generate(cert_dir)
        roots = pathlib.Path(client_ca).read_bytes() if client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=roots, require_client_auth=mtls)
    d = pathlib.Path(cert_dir)
    files = [d / CERT, d / KEY, *([pathlib.Path(client_ca)] if client_ca else [])]
    state = {"mtime": 0.0}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        mtime = max(f.stat().st_mtime for f in files)
        if mtime == state["mtime"]:
            return None
        state["mtime"] = mtime
        return grpc.ssl_server_certificate_configuration(
            [((d / KEY).read_bytes(), (d / CERT).read_bytes())],
            root_certificates=files[2].read_bytes() if client_ca else None,
        )

    initial = fetch()
    assert initial is not None, f"no certificate in {cert_dir}"
    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=mtls)
