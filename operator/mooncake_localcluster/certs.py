"""PKI for the local control plane: a CA, the apiserver serving cert, client certs, SA keys."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_VALIDITY = dt.timedelta(days=3650)
CLOCK_SKEW = dt.timedelta(minutes=5)
RSA_KEY_BITS = 2048
RSA_EXPONENT = 65537
SERVICE_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
MASTERS_GROUP = "system:masters"


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes

    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    def write(self, cert_path: Path, key_path: Path) -> None:
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        key_path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def make_ca(common_name: str = "mooncake-localcluster-ca") -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: KeyPair,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
) -> KeyPair:
    """A leaf certificate signed by ``ca`` for serving and/or client authentication."""
    ca_cert = ca.certificate()
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("CA key must be an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_service_account_keys() -> tuple[bytes, bytes]:
    """(private PEM, public PEM) RSA pair for signing/verifying service-account tokens."""
    key = rsa.generate_private_key(public_exponent=RSA_EXPONENT, key_size=RSA_KEY_BITS)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _key_pem(key), public


@dataclass(frozen=True)
class PkiPaths:
    root: Path

    @property
    def ca_crt(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def serving_crt(self) -> Path:
        return self.root / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.root / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.root / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.root / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.root / "sa.pub"

    def complete(self) -> bool:
        files = [self.ca_crt, self.ca_key, self.serving_crt, self.serving_key]
        files += [self.admin_crt, self.admin_key, self.sa_key, self.sa_pub]
        return all(path.is_file() for path in files)


def _serving_ips(cert_path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}


def _issue_serving(ca: KeyPair, paths: PkiPaths, ips: tuple[str, ...]) -> None:
    serving = issue_cert(
        ca,
        "kube-apiserver",
        dns_names=SERVICE_DNS_NAMES,
        ip_addresses=ips,
        server=True,
    )
    serving.write(paths.serving_crt, paths.serving_key)


def ensure_pki(root: Path, host: str, service_ips: tuple[str, ...] = ()) -> PkiPaths:
    """Create the whole PKI under ``root`` once; later calls reuse it.

    The apiserver's serving cert covers ``host`` and ``service_ips`` (the ``kubernetes``
    Service's ClusterIP); it is issued again from the same CA when an address is missing.
    """
    paths = PkiPaths(root)
    ips = tuple(dict.fromkeys((host, *service_ips)))
    if paths.complete():
        if not set(ips) <= _serving_ips(paths.serving_crt):
            ca = KeyPair(paths.ca_crt.read_bytes(), paths.ca_key.read_bytes())
            _issue_serving(ca, paths, ips)
        return paths
    root.mkdir(parents=True, exist_ok=True)
    ca = make_ca()
    ca.write(paths.ca_crt, paths.ca_key)
    _issue_serving(ca, paths, ips)
    admin = issue_cert(ca, "mooncake-admin", organizations=(MASTERS_GROUP,), client=True)
    admin.write(paths.admin_crt, paths.admin_key)
    sa_private, sa_public = make_service_account_keys()
    paths.sa_key.write_bytes(sa_private)
    paths.sa_key.chmod(0o600)
    paths.sa_pub.write_bytes(sa_public)
    return paths
