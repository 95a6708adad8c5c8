"""A throwaway certificate authority for TLS tests: a CA, a server certificate for 127.0.0.1
and localhost, and a client certificate, made once per process with the openssl command."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signed both certificates, the server's pair and a client's pair."""

    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


@functools.cache
def tls_files() -> TlsFiles:
    """The files, made the first time (a second or so) and shared by every caller after."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is not installed: apt-get install openssl")
    d = Path(tempfile.mkdtemp(prefix="search-proxy-tls-"))
    ca, ca_key = str(d / "ca.crt"), str(d / "ca.key")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=search-proxy test CA", "-keyout", ca_key, "-out", ca,
    )  # fmt: skip
    pairs = {}
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, csr, cert = (str(d / f"{name}.{kind}") for kind in ("key", "csr", "crt"))
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", key, "-out", csr)  # fmt: skip
        extfile = d / f"{name}.ext"
        extfile.write_text(ext + "\n")
        _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                 "-days", "2", "-extfile", str(extfile), "-out", cert)  # fmt: skip
        pairs[name] = (cert, key)
    return TlsFiles(ca, *pairs["server"], *pairs["client"])
