"""ems-control: the control plane of a fleet of ``ems-server`` daemons.

It holds tenants, their access keys and quotas in SQLite, serves them over REST to
operators (``ems tenants|keys|quota``) and to daemons (``ems-server --control URL``),
collects what each daemon reports and shows it on a status page. The web stack
(FastAPI, uvicorn) and ``cryptography`` are the ``control`` extra; the daemon side
(:mod:`ems.server.control_sync`) needs ``cryptography`` only.
"""
