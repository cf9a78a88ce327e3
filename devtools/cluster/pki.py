"""Certificates and keys for a loopback control plane, made with the openssl command line.

One CA signs the API server's serving certificate (valid for 127.0.0.1 and the in-cluster
names) and the admin client certificate (group system:masters); a front-proxy CA signs the
aggregation layer's client certificate. A separate key pair signs
service-account tokens. EC P-256 keys keep generation to a fraction of a second.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    ca_crt: Path
    ca_key: Path
    serving_crt: Path
    serving_key: Path
    admin_crt: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    front_proxy_ca_crt: Path
    front_proxy_client_crt: Path
    front_proxy_client_key: Path


def make_pki(d: Path, extra_ips: tuple[str, ...] = ()) -> Pki:
    """The plane's certificates; ``extra_ips``: addresses besides loopback the API server serves on."""
    d.mkdir(parents=True, exist_ok=True)
    p = Pki(
        ca_crt=d / "ca.crt", ca_key=d / "ca.key",
        serving_crt=d / "apiserver.crt", serving_key=d / "apiserver.key",
        admin_crt=d / "admin.crt", admin_key=d / "admin.key",
        sa_key=d / "sa.key", sa_pub=d / "sa.pub",
        front_proxy_ca_crt=d / "front-proxy-ca.crt",
        front_proxy_client_crt=d / "front-proxy-client.crt", front_proxy_client_key=d / "front-proxy-client.key",
    )
    _make_ca(p.ca_crt, p.ca_key, "/CN=specdecode-test-ca")
    san = ",".join([
        "IP:127.0.0.1", "IP:10.96.0.1", *(f"IP:{ip}" for ip in extra_ips),
        "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local",
    ])
    _sign(p.ca_crt, p.ca_key, p.serving_crt, p.serving_key, "/CN=kube-apiserver", "serverAuth", san)
    _sign(p.ca_crt, p.ca_key, p.admin_crt, p.admin_key, "/O=system:masters/CN=specdecode-admin", "clientAuth", None)
    # The front proxy (aggregation layer) needs its own CA, as in kubeadm's layout.
    front_proxy_ca_key = d / "front-proxy-ca.key"
    _make_ca(p.front_proxy_ca_crt, front_proxy_ca_key, "/CN=specdecode-test-front-proxy-ca")
    _sign(p.front_proxy_ca_crt, front_proxy_ca_key, p.front_proxy_client_crt, p.front_proxy_client_key,
          "/CN=front-proxy-client", "clientAuth", None)
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", p.sa_key)
    _run("pkey", "-in", p.sa_key, "-pubout", "-out", p.sa_pub)
    return p


def _make_ca(crt: Path, key: Path, subject: str) -> None:
    _run("req", "-x509", *_EC, "-keyout", key, "-out", crt, "-days", "3650", "-subj", subject,
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")


def _sign(ca_crt: Path, ca_key: Path, crt: Path, key: Path, subject: str, usage: str, san: str | None) -> None:
    csr = crt.with_suffix(".csr")
    ext = crt.with_suffix(".ext")
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature",
        f"extendedKeyUsage={usage}",
        "subjectKeyIdentifier=hash",
        "authorityKeyIdentifier=keyid,issuer",
    ]
    if san:
        lines.append(f"subjectAltName={san}")
    ext.write_text("\n".join(lines) + "\n")
    _run("req", "-new", *_EC, "-keyout", key, "-out", csr, "-subj", subject)
    _run("x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
         "-days", "3650", "-extfile", ext, "-out", crt)
    csr.unlink()
    ext.unlink()


def _run(*args: object) -> None:
    cmd = ["openssl", *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


def make_client_cert(p: Pki, d: Path, name: str, subject: str) -> tuple[Path, Path]:
    """A client certificate signed by the plane's CA: ``d/<name>.crt`` and ``d/<name>.key``."""
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    _sign(p.ca_crt, p.ca_key, crt, key, subject, "clientAuth", None)
    return crt, key


def make_serving_cert(ca_crt: Path, ca_key: Path, d: Path, name: str, san: str) -> tuple[Path, Path]:
    """A serving certificate signed by the plane's CA (which the API server trusts for webhooks),
    written as ``d/tls.crt`` and ``d/tls.key`` as controller-runtime's webhook server reads them."""
    d.mkdir(parents=True, exist_ok=True)
    crt, key = d / "tls.crt", d / "tls.key"
    _sign(ca_crt, ca_key, crt, key, f"/CN={name}", "serverAuth", san)
    return crt, key
