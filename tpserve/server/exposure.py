"""The start-up warning for a server reachable from other machines without an API key."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """Whether ``--host`` accepts connections from this machine only (``localhost`` or a
    loopback address). Any other name counts as reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int,
                     api_key: str | tuple[str, ...] | None) -> str | None:
    """The warning to log, or None when the server is loopback-only or needs a key."""
    if api_key or is_loopback_host(host):
        return None
    return (f"serving on {host}:{port}, reachable beyond this machine, without an API key: "
            "anyone who can reach the port can use the model; set --api-key, "
            "TPSERVE_API_KEY or VLLM_API_KEY (or bind --host 127.0.0.1)")
