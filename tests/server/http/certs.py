"""Self-signed TLS certificates for tests, made by the ``openssl`` command line (the
``cryptography`` package is not a dependency)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest


def self_signed(folder: Path, name: str = "server") -> tuple[Path, Path]:
    """A P-256 key and its self-signed certificate for 127.0.0.1 and localhost (valid a
    day, usable as its own CA): ``(keyfile, certfile)``."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed")
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def trusting(cafile: Path, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """A client context that trusts ``cafile`` only (and presents ``client``'s
    ``(keyfile, certfile)`` when given)."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    if client is not None:
        ctx.load_cert_chain(str(client[1]), str(client[0]))
    return ctx
