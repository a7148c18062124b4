"""Public test helpers: run a real ``ems-server`` (or ``ems-control``) in a temporary
directory.

::

    from ems.testing import run_server

    with run_server(capacity="64M") as server:
        os.environ.update(server.client_env())   # EMS_POOL=server, EMS_SOCKET_DIR=...
        ...                                       # Ems.init(...) now uses the daemon

The daemon is a subprocess (``python -m ems.server``); it is always stopped when the
``with`` block ends, also when the block raised. ``run_control(directory)`` does the
same for ``ems-control`` (``ems.testing.control``). Both are a :class:`ChildProcess`:
one handle that starts our programs from this very ``ems`` and stops them by PID.
"""

from ems.testing.control import ControlProcess, run_control
from ems.testing.process import ChildProcess
from ems.testing.server import ServerProcess, disk_after_recovery, run_server

__all__ = ["ChildProcess", "ControlProcess", "ServerProcess", "disk_after_recovery",
           "run_control", "run_server"]
