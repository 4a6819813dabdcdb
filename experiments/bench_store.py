"""Round formation at scale on both rendezvous stores (prints figures).

N simulated sites in this process, each with its own etcd client, lease and watch of ``plan/``
(the direct ``--rendezvous etcd://`` mode), on a 3-member etcd cluster started here
(``tests/etcd_cluster.py``; needs Debian's ``etcd-server``): all join, N-1 become ready for round
0, then the last one forms the plan. Printed: the time from the last ready to the plan seen by
every site, the time the N-1 readies took and etcd's revisions per second during them; the same
for the in-memory core.
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.etcd_store import EtcdRendezvous, EtcdStoreConfig
from experiments import bench


def _config(n: int) -> RendezvousConfig:
    return RendezvousConfig(
        min_sites=1,
        initial_sites=n,
        quorum_timeout_s=600.0,
        heartbeat_interval_s=10.0,
        heartbeat_timeout_s=120.0,
        reduce_timeout_s=10.0,
        broadcast_timeout_s=20.0,
    )


def bench_etcd(url: str, n: int, num_threads: int) -> dict:
    store = EtcdStoreConfig.parse(url, run=f"bench-{uuid.uuid4().hex[:8]}", timeout_s=30.0)
    cfg = _config(n)
    with ThreadPoolExecutor(num_threads) as ex:
        cores = list(ex.map(lambda _: EtcdRendezvous(store, cfg), range(n)))
        list(ex.map(lambda i: cores[i].join(f"s{i:04d}", f"addr-{i}", now=0.0), range(n)))
        rev0 = cores[0].store.etcd.range(b"/none")[2]
        t0 = time.monotonic()
        waits = list(ex.map(lambda i: cores[i].ready(f"s{i:04d}", 0, now=0.0).status, range(n - 1)))
        t1 = time.monotonic()
        rev1 = cores[0].store.etcd.range(b"/none")[2]
    assert set(waits) == {"wait"}, set(waits)
    t_last = time.monotonic()
    d = cores[-1].ready(f"s{n - 1:04d}", 0, now=0.0)
    assert d.status == "plan" and len(d.plan.members) == n
    for c in cores:
        c.store.wait(0, 60.0)
    t_all = time.monotonic()
    missing = sum(1 for c in cores if 0 not in c.store._plans)
    seen = sorted(c.store.plan_seen_at.get(0, t_all) - t_last for c in cores[:-1])
    for c in cores:
        c.close()
    return {
        "last_ready_to_plan_seen_by_all_s": seen[-1],
        "first_watch_s": seen[0],
        "median_watch_s": seen[len(seen) // 2],
        "readies_s": t1 - t0,
        "writes_per_s": (rev1 - rev0) / (t1 - t0),
        "sites_without_plan": missing,
    }


def bench_memory(n: int) -> dict:
    core = RendezvousCore(_config(n))
    for i in range(n):
        core.join(f"s{i:04d}", f"addr-{i}", now=time.monotonic())
    t0 = time.monotonic()
    for i in range(n - 1):
        assert core.ready(f"s{i:04d}", 0, now=time.monotonic()).status == "wait"
    t1 = time.monotonic()
    d = core.ready(f"s{n - 1:04d}", 0, now=time.monotonic())
    seen = [core.ready(f"s{i:04d}", 0, now=time.monotonic()).status for i in range(n)]
    t2 = time.monotonic()
    assert d.status == "plan" and set(seen) == {"plan"}
    return {"last_ready_to_plan_seen_by_all_s": t2 - t1, "readies_s": t1 - t0}


def main(argv: list[str] | None = None) -> int:
    ap = bench.parser(__doc__, smoke="20 sites")
    ap.add_argument("--sites", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=32, help="client threads of the load process")
    args = ap.parse_args(argv)
    n = 20 if args.smoke else args.sites
    from tests.etcd_cluster import EtcdCluster, require_etcd

    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(Path(tmp), require_etcd())
        try:
            cluster.start()
            etcd = bench_etcd(cluster.url, n, args.threads)
        finally:
            cluster.stop()
    mem = bench_memory(n)
    print(f"sites: {n}")
    print(
        "| store | last ready -> plan seen by all (s) | ... by the first / median watch (s) | N-1 readies (s) | etcd writes/s |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| etcd (3 members) | {etcd['last_ready_to_plan_seen_by_all_s']:.3f} | {etcd['first_watch_s']:.3f} / "
        f"{etcd['median_watch_s']:.3f} | {etcd['readies_s']:.2f} | {etcd['writes_per_s']:.0f} |"
    )
    print(f"| in-memory | {mem['last_ready_to_plan_seen_by_all_s']:.4f} | - | {mem['readies_s']:.3f} | - |")
    print("(every etcd site's watch runs in this one process: 'seen by all' includes decoding the plan N times here)")
    bench.write(args, "bench_store", {"sites": n, "etcd": etcd, "memory": mem})
    if etcd["sites_without_plan"]:
        print(f"WARNING: {etcd['sites_without_plan']} sites' watches did not deliver the plan within 60 s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
