"""TLS for the ext_proc port, as GIE's EPP does it: a self-signed certificate generated at start,
unless ``--cert-path DIR`` holds ``tls.crt`` and ``tls.key``; ALPN h2 comes from gRPC itself."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(hostname: str = "kvpick-picker") -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a one-year self-signed certificate (PEM key, PEM cert)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName(hostname), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def load_or_generate(cert_dir: str | None) -> tuple[bytes, bytes]:
    if cert_dir:
        d = pathlib.Path(cert_dir)
        return (d / "tls.key").read_bytes(), (d / "tls.crt").read_bytes()
    return self_signed()


def server_credentials(cert_dir: str | None, reload: bool = False) -> grpc.ServerCredentials:
    """Server credentials; with ``reload`` the files in ``cert_dir`` are re-read on each handshake
    when they changed (gRPC's dynamic credentials), like GIE's ``--enable-cert-reload``."""
    if not (cert_dir and reload):
        key, cert = load_or_generate(cert_dir)
        return grpc.ssl_server_credentials([(key, cert)])
    d = pathlib.Path(cert_dir)
    state = {"mtime": 0.0}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        mtime = max((d / "tls.crt").stat().st_mtime, (d / "tls.key").stat().st_mtime)
        if mtime == state["mtime"]:
            return None
        state["mtime"] = mtime
        return grpc.ssl_server_certificate_configuration(
            [((d / "tls.key").read_bytes(), (d / "tls.crt").read_bytes())]
        )

    initial = fetch()
    assert initial is not None, f"no certificate in {cert_dir}"
    return grpc.dynamic_ssl_server_credentials(initial, fetch)
