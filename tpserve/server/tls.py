"""HTTPS for the server (vLLM's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs``; uvicorn serves it): the flags checked as a set when the config is
built (``check_tls_flags``), and the files read once at start-up on the rank that serves
HTTP (``check_tls_files``), so that a bad file stops the start before the model loads
instead of failing in uvicorn after it."""

from __future__ import annotations

import os
import ssl

SSL_CERT_REQS = (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED))


def check_tls_flags(keyfile: str | None, certfile: str | None, ca_certs: str | None,
                    reqs: int) -> None:
    """ValueError naming the flag for a combination uvicorn would refuse or ignore: a key
    without its certificate (or the reverse), client-certificate options without TLS, or
    required client certificates without the CAs to check them against."""
    if reqs not in SSL_CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0 (ssl.CERT_NONE), 1 (CERT_OPTIONAL) "
                         f"or 2 (CERT_REQUIRED), got {reqs}")
    if (keyfile is None) != (certfile is None):
        given, missing = (("--ssl-keyfile", "--ssl-certfile") if certfile is None
                          else ("--ssl-certfile", "--ssl-keyfile"))
        raise ValueError(f"{given} needs {missing} (TLS takes a key and its certificate; "
                         "a PEM file holding both may be given to both)")
    if certfile is None:  # uvicorn would ignore these
        if ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        if reqs != ssl.CERT_NONE:
            raise ValueError(f"--ssl-cert-reqs {reqs} needs --ssl-keyfile and "
                             "--ssl-certfile")
    elif reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {reqs} checks client certificates against "
                         "--ssl-ca-certs: give the CA file")


def _encrypted_key() -> str:
    raise LookupError("encrypted")  # OpenSSL asks for the key's password: it has none


def check_tls_files(keyfile: str | None, certfile: str | None, ca_certs: str | None) -> None:
    """ValueError naming the flag for TLS files uvicorn would fail on after the model load:
    missing or unreadable, a key that does not match its certificate or needs a password
    (uvicorn would ask for it on the terminal), CAs that are no certificates. Nothing
    without TLS."""
    if certfile is None:
        return
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile),
                       ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path!r}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile, keyfile, password=_encrypted_key)
    except LookupError:
        raise ValueError(f"--ssl-keyfile: {keyfile!r} is encrypted (password-protected); "
                         "give an unencrypted key") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--ssl-certfile {certfile!r} and --ssl-keyfile {keyfile!r}: not a "
                         f"PEM certificate and its key ({exc})") from None
    if ca_certs is not None:
        try:
            ctx.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ssl-ca-certs {ca_certs!r}: no PEM certificates ({exc})"
                             ) from None
