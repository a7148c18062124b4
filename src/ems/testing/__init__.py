"""Public test helpers: run a real ``ems-server`` in a temporary directory.

::

    from ems.testing import run_server

    with run_server(capacity="64M") as server:
        os.environ.update(server.client_env())   # EMS_POOL=server, EMS_SOCKET_DIR=...
        ...                                       # Ems.init(...) now uses the daemon

The daemon is a subprocess (``python -m ems.server``); it is always stopped when the
``with`` block ends, also when the block raised.
"""

from ems.testing.server import ServerProcess, run_server

__all__ = ["ServerProcess", "run_server"]
