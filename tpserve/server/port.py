"""The HTTP port, checked before anything slow (a model fetch, the weights' load)."""

from __future__ import annotations

import errno
import socket


def check_port_free(host: str, port: int) -> None:
    """Binds ``host:port`` once and lets go, so that a taken port stops the start before
    the model loads (uvicorn binds only after). ValueError (exit 2) names the port."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use; stop what "
                                 f"listens there or choose another --port") from None
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
