"""Single-host rendezvous: a ``FileStore`` in a private folder, nothing on the network.

torch's ``TCPStore`` listens on every interface (``[::]:PORT``) whatever host it is given,
without authentication, for the life of the group; and gloo's default device binds the
address the host name resolves to. When every rank runs on this machine (``serve -tp N``
spawning its workers, ``run_ranks``), the store is a file in a folder only this user can
enter (``mkdtemp``: mode 0700), and gloo binds 127.0.0.1. Multi-node serving (torchrun)
keeps the endpoint the user gives.
"""

from __future__ import annotations

import shutil
import tempfile

FILE_SCHEME = "file://"
LOOPBACK = "127.0.0.1"


class LocalRendezvous:
    """A fresh private folder holding the store file; ``close`` removes it."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="tpserve-rendezvous-")
        self.init_method = f"{FILE_SCHEME}{self.folder}/store"

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def is_local(init_method: str | None) -> bool:
    """Whether ``init_method`` is a single-host rendezvous (so gloo binds loopback)."""
    return init_method is not None and init_method.startswith(FILE_SCHEME)
