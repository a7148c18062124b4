"""Helpers and fixtures shared by the test suites, imported as ``support.*``
(``pythonpath = ["tests"]`` in pyproject.toml puts ``tests/`` on the path):

* ``itest_support`` — waiting, the daemon's counters, saves and loads through a
  transport's verbs, the leak check a pool fixture runs at teardown;
* ``itest_fixtures`` — the daemon and client-process fixtures of ``tests/integration``
  and ``tests/faults`` (their conftests import them);
* ``client_worker`` — a client process (``python client_worker.py COMMAND JSON``) and
  the value pattern it checks;
* ``control_support``, ``cluster_support`` — the control-plane and cluster helpers.
"""
