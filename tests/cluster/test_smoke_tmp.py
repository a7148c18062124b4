from conftest import save, load, opt
def test_smoke(shared_cluster, make_host):
    a = make_host(shared_cluster.seed)
    b = make_host(shared_cluster.seed)
    keys = [f"smoke-{i}" for i in range(6)]
    assert save(a, keys, 100_000) == 6
    import time; time.sleep(0.3)
    print(a.report().get("cluster")["tier"]); print(a.server.log()[-3000:])
    assert load(b, keys, 100_000) == (6, 0)
    print(b.report()["cluster"]["tier"], b.tenant_row())
    assert load(b, keys, 100_000, opt(read_local_only=True)) == (6, 0)
