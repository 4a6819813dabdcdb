"""The topology's helper process: userspace delayer and periodic-partition scheduler.

Started by :class:`netem.Topology` (``python -m netem._agent --state-dir DIR``) inside
the hub namespace, one per topology. It

* delays packets: NFQUEUE queue ``i`` holds the packets routed to site ``i`` (the hub's
  FORWARD rule queues them there) until ``arrival + delay ± jitter``, then accepts them;
  packets to one site leave in arrival order. Backend ``nfqueue-c``: the compiled
  delayer (``netem/delayer.c``) runs as this process's child, binds the queues and gets
  the delays over a pipe (:class:`netem._cdelay.CDelayer`); ``nfqueue-userspace``: this
  process binds them itself (netfilterqueue, one Python callback per packet);
* rewrites the "flap" partition rules when a site's periodic outage starts or ends;
* answers JSON-line requests on ``DIR/agent.sock``: ``config``, ``stats``, ``ping``;
* with ``--watch-pid``, tears the whole topology down if that process dies (so a
  SIGKILLed owner leaves nothing behind).

Throughput: the Python loop handles ~65k packets/s per core on a quiet machine
(netfilterqueue with COPY_META) and 4-8k/s under load; the compiled delayer costs a few
hundred ns per packet (experiments/RESULTS.md, "netem's own UDP ceiling").
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import select
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from . import _rules
from ._cdelay import CDelayer
from ._sys import delete_namespace, ns_cmd, run
from .profiles import LinkParams

logger = logging.getLogger("netem.agent")

# Packets held per site at most (the kernel drops beyond); the environment may lower it (tests).
MAX_QUEUE_LEN = int(os.environ.get("DTRAIN_NETEM_MAX_QUEUE_LEN", "20000"))
SOCK_RCVBUF = 8 << 20


class _SiteQueue:
    """One site's NFQUEUE binding and its FIFO of held packets."""

    def __init__(self, site: int) -> None:
        from netfilterqueue import COPY_META, NetfilterQueue

        self.site = site
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.reorder_p = 0.0  # share of packets held reorder_gap_s longer (overtaken by the next ones)
        self.reorder_gap_s = 0.0
        self.last_due = 0.0
        self.last_late_due = 0.0
        self.held: collections.deque = collections.deque()
        self.held_back: collections.deque = collections.deque()  # the reordered ones, a FIFO of their own
        self.num_reordered = 0
        self.num_delayed = 0
        self.max_held = 0
        self.num_late = 0  # released more than 1 ms after their due time
        self.max_late_s = 0.0
        self.nfq = NetfilterQueue()
        self.nfq.bind(site, self._on_packet, max_len=MAX_QUEUE_LEN, mode=COPY_META, sock_len=SOCK_RCVBUF)
        self.fd = self.nfq.get_fd()
        os.set_blocking(self.fd, False)

    def _on_packet(self, pkt) -> None:
        now = time.monotonic()
        delay = self.delay_s
        if self.jitter_s:
            delay = max(0.0, delay + random.uniform(-self.jitter_s, self.jitter_s))
        if self.reorder_p and random.random() < self.reorder_p:
            due = self.last_late_due = max(now + delay + self.reorder_gap_s, self.last_late_due)
            self.held_back.append((due, pkt))
            self.num_delayed += 1
            self.num_reordered += 1
            return
        due = max(now + delay, self.last_due)
        self.last_due = due
        self.held.append((due, pkt))
        self.num_delayed += 1
        if len(self.held) > self.max_held:
            self.max_held = len(self.held)

    def next_due(self) -> float | None:
        dues = [q[0][0] for q in (self.held, self.held_back) if q]
        return min(dues) if dues else None

    def release(self, now: float) -> None:
        for held in (self.held_back, self.held):
            while held and held[0][0] <= now:
                due, pkt = held.popleft()
                pkt.accept()
                late = now - due
                if late > 0.001:
                    self.num_late += 1
                    if late > self.max_late_s:
                        self.max_late_s = late

    def close(self) -> None:
        for held in (self.held_back, self.held):
            while held:
                try:
                    held.popleft()[1].accept()
                except Exception:  # queue already gone: the kernel drops them
                    break
        self.nfq.unbind()


class Agent:
    def __init__(self, state_dir: Path, watch_pid: int | None) -> None:
        self.state_dir = state_dir
        self.topo = json.loads((state_dir / "topology.json").read_text())
        self.num_sites = len(self.topo["site_namespaces"])
        self.links = [LinkParams() for _ in range(self.num_sites)]
        self.flap_epoch = 0.0
        self.flap_down: list[int] = []
        self.next_flap: float | None = None
        self.queues: list[_SiteQueue] = []
        self.cdelay: CDelayer | None = None
        if self.topo["backends"]["delay"] == "nfqueue-userspace":
            self.queues = [_SiteQueue(i) for i in range(self.num_sites)]
        elif self.topo["backends"]["delay"] == "nfqueue-c":
            self.cdelay = CDelayer(
                self.topo["delayer_binary"],
                self.num_sites,
                max_queue_len=MAX_QUEUE_LEN,
                rcvbuf_bytes=SOCK_RCVBUF,
                marker=str(state_dir),
            )
        self.watch_fd = os.pidfd_open(watch_pid) if watch_pid else None
        self.sock_path = state_dir / "agent.sock"
        self.sock_path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.sock_path))
        self.listener.listen(16)
        self.conns: dict[socket.socket, tuple[float, bytearray]] = {}

    # ------------------------------------------------------------------ control
    def _handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op == "config":
            self.links = [LinkParams.from_dict(d) for d in req["links"]]
            self.flap_epoch = float(req["flap_epoch"])
            for q, p in zip(self.queues, self.links):
                q.delay_s = p.delay_ms / 1000.0
                q.jitter_s = p.jitter_ms / 1000.0
                q.reorder_p = p.reorder_pct / 100.0
                q.reorder_gap_s = p.reorder_gap_ms / 1000.0
            if self.cdelay is not None:
                for i, p in enumerate(self.links):
                    self.cdelay.set_delay(
                        i, p.delay_ms / 1000.0, p.jitter_ms / 1000.0, p.reorder_pct, p.reorder_gap_ms / 1000.0
                    )
            self._update_flap(time.time(), force=True)
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "pid": os.getpid(), "flap_down": self.flap_down, **self._delay_stats()}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _delay_stats(self) -> dict:
        """Per-site delayer counters (same keys for both delayers) and the compiled delayer's pid."""
        if self.cdelay is not None:
            sites = self.cdelay.stats()
            return {"delayer_pid": self.cdelay.proc.pid, "delayer_wakeups": self.cdelay.num_wakeups, "sites": sites}
        sites = [
            {
                "delayed": q.num_delayed,
                "held": len(q.held) + len(q.held_back),
                "max_held": q.max_held,
                "late_1ms": q.num_late,
                "max_late_ms": round(q.max_late_s * 1000, 3),
                "reordered": q.num_reordered,
            }
            for q in self.queues
        ]
        return {"delayer_pid": None, "delayer_wakeups": None, "sites": sites}

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.setblocking(False)
        self.conns[conn] = (time.monotonic() + 5.0, bytearray())

    def _serve(self, conn: socket.socket) -> None:
        """Read from a control connection without blocking the packet loop; answer a full line."""
        _, buf = self.conns[conn]
        try:
            chunk = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        buf += chunk
        if chunk and not buf.endswith(b"\n"):
            return
        del self.conns[conn]
        with conn:
            if not chunk and not buf.endswith(b"\n"):
                return  # the client went away mid-request
            try:
                resp = self._handle(json.loads(buf))
            except Exception as e:  # report to the caller, keep serving
                logger.exception("request failed")
                resp = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            try:
                conn.settimeout(1.0)
                conn.sendall(json.dumps(resp).encode() + b"\n")
            except OSError as e:
                logger.warning("could not answer a control request: %s", e)

    def _expire_conns(self, now: float) -> None:
        for conn, (deadline, _) in list(self.conns.items()):
            if now > deadline:
                del self.conns[conn]
                conn.close()

    # ------------------------------------------------------------------ flapping
    def _update_flap(self, wall: float, *, force: bool = False) -> None:
        down = _rules.flap_down_sites(self.links, self.flap_epoch, wall)
        self.next_flap = _rules.flap_next_change(self.links, self.flap_epoch, wall)
        if down == self.flap_down and not force:
            return
        self.flap_down = down
        pairs = _rules.isolate_pairs(down, self.num_sites)
        hub = self.topo["hub_namespace"]
        if self.topo["backends"]["partition"] == "nftables":
            run(ns_cmd(hub, ["nft", "-f", "-"]), input=_rules.nft_chain("flap", _rules.part_matches(pairs)))
        else:
            run(
                ns_cmd(hub, ["iptables-restore", "--noflush"]),
                input=_rules.ipt_chain("DTN-FLAP", _rules.ipt_part_rules(pairs)),
            )
        logger.info("flap: sites down now: %s", down)

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        by_fd = {q.fd: q for q in self.queues}
        fixed = [self.listener, *by_fd]
        if self.watch_fd is not None:
            fixed.append(self.watch_fd)
        if self.cdelay is not None:
            fixed.append(self.cdelay.fd)
        while True:
            now = time.monotonic()
            timeout = 1.0
            for q in self.queues:
                due = q.next_due()
                if due is not None:
                    timeout = min(timeout, due - now)
            if self.next_flap is not None:
                timeout = min(timeout, self.next_flap - time.time())
            ready, _, _ = select.select(fixed + list(self.conns), [], [], max(timeout, 0.0))
            for r in ready:
                if r is self.listener:
                    self._accept()
                elif r in self.conns:
                    self._serve(r)
                elif r == self.watch_fd:
                    self.teardown_topology()
                    return
                elif self.cdelay is not None and r == self.cdelay.fd:
                    if self.cdelay.poll_dead():
                        fixed.remove(r)  # requests now answer that it exited
                else:
                    by_fd[r].nfq.run(block=False)
            now = time.monotonic()
            for q in self.queues:
                due = q.next_due()
                if due is not None and due <= now:
                    q.release(now)
            if self.next_flap is not None and time.time() >= self.next_flap:
                self._update_flap(time.time())
            if self.conns:
                self._expire_conns(now)

    def teardown_topology(self) -> None:
        """The owner died without closing: remove everything of this topology."""
        logger.warning("owner process died; tearing topology %s down", self.topo["name"])
        self.close()
        for ns in [*self.topo["site_namespaces"], self.topo["hub_namespace"]]:
            try:
                delete_namespace(ns)
            except Exception:
                logger.exception("deleting %s failed", ns)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        try:
            self.state_dir.parent.rmdir()  # only when no other topology is left
        except OSError:
            pass

    def close(self) -> None:
        for q in self.queues:
            q.close()
        self.queues = []
        if self.cdelay is not None:
            self.cdelay.close()
            self.cdelay = None
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self.listener.close()
        self.sock_path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m netem._agent")
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--watch-pid", type=int, default=None)
    ap.add_argument("--rt-priority", type=int, default=20, help="SCHED_FIFO priority; 0 = off")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s agent[%(process)d] %(levelname)s %(message)s"
    )

    def _stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.rt_priority > 0:
        # Real-time priority: woken on time even while training jobs load every core
        # (measured: p99 timer overshoot 0.45 ms under load vs 16 ms without).
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_priority))
        except OSError as e:
            logger.warning("could not get SCHED_FIFO priority (%s); delays may overshoot", e)
    agent = Agent(args.state_dir, args.watch_pid)
    try:
        agent.run()
    finally:
        if agent.queues or agent.cdelay or agent.sock_path.exists():
            agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
