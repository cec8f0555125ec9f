"""Certificates for a local etcd cluster with TLS (``coordinator --etcd N --tls``), made offline.

:func:`make_certificates` writes a CA, one server certificate for the members (valid for their
host) and one client certificate for islands and the supervisor into a folder (keys mode 600).
The client certificate has no subject name, only a subject alternative name: etcd's JSON gateway
refuses a client certificate that carries a name when members check client certificates (the
user comes from etcd's authentication instead, :mod:`lightning_islands.link.etcd_credentials`).
In production use your own CA; these are for tests, demos and a single site.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    """Where :func:`make_certificates` wrote the CA, the members' and the clients' files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(folder: Path, host: str = "127.0.0.1", days: int = 30) -> Certificates:
    """A CA, a server certificate for ``host`` (and ``localhost``) and a client certificate, in ``folder``."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as err:
        raise RuntimeError("certificates for --tls need the cryptography package: pip install "
                           "'lightning-islands[etcd]'") from err
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def named(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
        crt, pem = folder / f"{stem}.crt", folder / f"{stem}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
        os.chmod(pem, 0o600)
        return crt, pem

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(named("lightning-islands etcd CA"))
          .issuer_name(named("lightning-islands etcd CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(subject: x509.Name, names: list, usage: list) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(names), critical=not list(subject))
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .sign(ca_key, hashes.SHA256()))
        return key, cert

    try:
        host_name = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        host_name = x509.DNSName(host)
    server = leaf(named("etcd"), [host_name, x509.DNSName("localhost")],
                  [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client = leaf(x509.Name([]), [x509.DNSName("lightning-islands-client")], [ExtendedKeyUsageOID.CLIENT_AUTH])
    ca_path = folder / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_cert, server_key = write("member", *server)
    client_cert, client_key = write("client", *client)
    return Certificates(ca_path, server_cert, server_key, client_cert, client_key)
