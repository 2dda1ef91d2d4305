"""The coordinator's TLS identity: its certificate, key and server context.

Clients authenticate the coordinator by the SHA-256 of its certificate (a pin, see
`protocol.pinning`), not by a certificate authority, so a self-signed certificate is
enough. `load_identity` uses the operator's PEM files when the config names them
(`tls_cert`, `tls_key`); otherwise it makes an ECDSA P-256 key and a self-signed
certificate once, beside the database (`<db>.tls-key.pem`, `<db>.tls-cert.pem`, both
0600), and reuses them on every restart, so the fingerprint nodes were given stays valid
for the life of the run; the key that signs members' credits is derived from it
(`credit_key`). `server_context` serves TLS 1.3 only (every client is this
repository's Python code). Torch-free.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from coordinator.config import CoordinatorConfig
from protocol.identity import NodeKey
from protocol.pinning import fingerprint

CERT_YEARS = 20  # validity of a generated certificate (clients check the pin, not dates)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TlsIdentity:
    cert: Path  # PEM certificate the server presents
    key: Path  # PEM private key of `cert`
    fingerprint: str  # `sha256:<hex>` of the certificate's DER bytes: the clients' pin
    generated: bool  # True when this start made the pair


def default_paths(db: str | Path) -> tuple[Path, Path]:
    """Where a generated certificate and key live: beside the database."""
    db = Path(db)
    return db.with_name(db.name + ".tls-cert.pem"), db.with_name(db.name + ".tls-key.pem")


def _write_private(path: Path, data: bytes) -> None:
    """Create `path` with mode 0600 (never over an existing file) and write `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def generate(cert_path: Path, key_path: Path, common_name: str) -> None:
    """A fresh P-256 key and a self-signed certificate for it, written 0600."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365 * CERT_YEARS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_private(key_path, key_pem)
    try:
        _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    except BaseException:
        key_path.unlink(missing_ok=True)
        raise


def cert_fingerprint(cert_path: Path) -> str:
    """The pin of a PEM certificate file (its first certificate)."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return fingerprint(cert.public_bytes(serialization.Encoding.DER))


def load_identity(cfg: CoordinatorConfig) -> TlsIdentity:
    """The operator's certificate, or the generated one beside the database (made now if
    absent). ValueError when only one of a generated pair exists or the files do not load."""
    generated = False
    if cfg.tls_cert is not None and cfg.tls_key is not None:
        cert, key = Path(cfg.tls_cert).expanduser(), Path(cfg.tls_key).expanduser()
    else:
        cert, key = default_paths(cfg.db)
        if cert.exists() != key.exists():
            raise ValueError(
                f"found only one of {cert} and {key}: restore the other, or remove both to"
                " make a new certificate (nodes pinned to the old one will refuse the new)"
            )
        if not cert.exists():
            generate(cert, key, f"agora-coordinator {cfg.run_id}")
            generated = True
    try:
        pin = cert_fingerprint(cert)
        server_context(cert, key)  # the pair must load and match
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use TLS certificate {cert} with key {key}: {exc}") from exc
    return TlsIdentity(cert=cert, key=key, fingerprint=pin, generated=generated)


def credit_key(key: Path) -> NodeKey:
    """The ed25519 key that signs members' credits (`protocol.credit`), derived from the
    TLS private key: kept as long as the certificate is, with no file of its own, and
    never the TLS key itself."""
    return NodeKey(hashlib.sha256(b"agora/credit-key/v1\0" + key.read_bytes()).digest())


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """TLS 1.3, no client certificates (clients prove themselves by signed requests)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.num_tickets = 0  # no session resumption: no post-handshake records to clients
    ctx.load_cert_chain(str(cert), str(key))
    return ctx
