"""A joining or resynchronising site takes the whole training position (issue 13,
item 3): the inner step count, the inner optimizer's state and the inner and outer LR
schedulers' states, from a donor of the round it joins at; a site whose own state is
current keeps its own. In-process sites (one network, one rendezvous)."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.configs import DiLoCoConfig
from dtrain.diloco import DiLoCo
from dtrain.protocol import Member
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.transports.inproc import InprocNetwork, InprocTransport

pytestmark = pytest.mark.timeout(60)

H = 5
WARMUP, TOTAL = 10, 100
SMALL = BucketConfig(bucket_bytes=512, chunk_bytes=256)


def _warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (TOTAL - WARMUP))))


def _site(site_id: str, net: InprocNetwork, core: RendezvousCore, *, join: bool = True, hook: bool = False):
    torch.manual_seed(0)  # identical initial weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    d = DiLoCo(
        model,
        opt,
        config=DiLoCoConfig(site_id=site_id, sync_every=H, buckets=SMALL, hook_optimizer=hook),
        transport=InprocTransport(net),
        rendezvous=InprocRendezvousClient(core),
        inner_scheduler=sched,
        outer_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda r: 0.9**r),
        _defer_join=not join,
    )
    return d, model, opt, sched


def _train(d: DiLoCo, model, opt, sched, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()  # with hook_optimizer, the round runs in here, before the scheduler's step
        opt.zero_grad()
        sched.step()
        if not d.config.hook_optimizer:
            d.step()


def _adam_steps(opt) -> set[float]:
    return {float(s["step"]) for s in opt.state.values()}


def test_late_joiner_takes_the_donors_inner_step_optimizer_and_schedulers():
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.5))
    a, ma, oa, sa = _site("a", net, core)
    b = None
    try:
        _train(a, ma, oa, sa, 3 * H, seed=1)  # rounds 0..2 alone
        assert a.round == 3 and a.inner_steps == 3 * H
        b, mb, ob, sb = _site("b", net, core)
        assert b.round == 3 and b.healed_from == "a"
        assert b.inner_steps == a.inner_steps == 15
        assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"] == pytest.approx(1e-2 * _warmup_cosine(15))
        assert _adam_steps(ob) == _adam_steps(oa) == {15.0}
        for p_a, p_b in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(oa.state[p_a]["exp_avg"], ob.state[p_b]["exp_avg"])
            assert torch.equal(p_a.detach(), p_b.detach())  # θ too
        assert sb.last_epoch == sa.last_epoch == 15
        assert (
            [s.last_epoch for s in b.outer_schedulers]
            == [s.last_epoch for s in a.outer_schedulers]
            == [3] * len(a.outer_schedulers)
        )
        assert [o.param_groups[0]["lr"] for o in b.state.optimizers] == [
            o.param_groups[0]["lr"] for o in a.state.optimizers
        ]
    finally:
        for d in (a, b):
            if d is not None:
                d.close(wait=False)


def test_a_restarted_site_keeps_its_own_current_position_and_heals_a_stale_one():
    """A site that resumes from its own checkpoint of the current round keeps its own
    inner state (nothing is pulled); one whose checkpoint is stale takes a donor's: a's, or
    that of r0, which holds a's position of round 3 (every donor is asked at once and the
    first answer of the round is taken)."""
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.5))
    a, ma, oa, sa = _site("a", net, core)
    others = []
    try:
        _train(a, ma, oa, sa, H, seed=1)
        stale = (a.state_dict(), a.training_position())  # round 1
        _train(a, ma, oa, sa, 2 * H, seed=2)
        current = (a.state_dict(), a.training_position())  # round 3
        for (sd, pos), want_from in ((current, None), (stale, ("a", "r0"))):
            d, m, o, s = _site(f"r{len(others)}", net, core, join=False)
            others.append(d)
            d.load_state_dict(sd)
            d.load_training_position(pos)
            own_lr = o.param_groups[0]["lr"]
            d.join()
            assert d.round == 3 and (d.healed_from in want_from if want_from else d.healed_from is None)
            if want_from is None:  # current: its own position (round 3's, which is a's too)
                assert o.param_groups[0]["lr"] == own_lr and d.inner_steps == 3 * H
            else:  # stale (round 1): the position of round 3 (a's), not its own of round 1
                assert own_lr == pytest.approx(1e-2 * _warmup_cosine(H))
                assert o.param_groups[0]["lr"] == oa.param_groups[0]["lr"] and d.inner_steps == 3 * H
                assert _adam_steps(o) == {15.0}
    finally:
        for d in [a, *others]:
            d.close(wait=False)


def test_a_donor_past_the_round_ends_the_position_pull_at_once():
    """A site whose θ is of round 1 asks for the position of round 1; the donor is at round 3
    (the group moved on while θ was pulled). It answers with its own round, which ends the
    pull at once, whatever the other donor answers: the site keeps its own position, and
    its next round resyncs θ (at 30% loss a resync went on asking stalled donors for 64 s
    more)."""
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.5))
    a, ma, oa, sa = _site("a", net, core)
    d = None
    try:
        _train(a, ma, oa, sa, H, seed=1)
        stale = a.state_dict()  # round 1
        _train(a, ma, oa, sa, 2 * H, seed=2)  # a is at round 3
        d, *_ = _site("d", net, core, join=False)
        d.load_state_dict(stale)
        assert d.round == 1
        donor = Member(site_id="a", address=a.engine.transport.address)
        assert d.site._fetch_position(donor, 1, 5.0) == (None, "past")
        assert d._heal([donor, Member(site_id="b", address="inproc:nowhere")]) is False
        assert d.healed_from is None
    finally:
        for x in (a, d):
            if x is not None:
                x.close(wait=False)


def _lockstep(sites, steps: int) -> None:
    """Train every site ``steps`` inner steps, step by step in turn (rounds of several
    sites need every member at its round at once: each site's own thread)."""
    import threading

    threads = [threading.Thread(target=_train, args=(*s, steps, i)) for i, s in enumerate(sites)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)


def test_hooked_joiner_and_resynced_site_keep_the_donors_schedule_to_the_end():
    """With ``hook_optimizer`` the round runs inside ``opt.step()``, before the caller's
    ``sched.step()`` (issue 33): a joiner, and a site healed by a resync, take the donor's
    LR schedule and AdamW step count exactly and keep them equal to the end of the run."""
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.5))
    a = _site("a", net, core, hook=True)
    b = None
    try:
        _train(*a, 3 * H, seed=1)  # rounds 0..2 alone
        b = _site("b", net, core, hook=True)
        assert b[0].round == 3 and b[0].healed_from == "a"
        _lockstep([a, b], 2 * H)  # rounds 3 and 4 together
        assert a[0].round == b[0].round == 5
        assert b[3].last_epoch == a[3].last_epoch == 5 * H
        assert b[2].param_groups[0]["lr"] == a[2].param_groups[0]["lr"] == pytest.approx(1e-2 * _warmup_cosine(5 * H))
        assert _adam_steps(b[2]) == _adam_steps(a[2]) == {5.0 * H}
        # b misses round 5 (a runs it alone), then resyncs inside its own opt.step()
        _train(*a, H, seed=3)
        assert a[0].round == 6
        _train(*b, H, seed=4)
        assert b[0].round == 6 and b[0].last_outcome.status.value == "resynced"
        _train(*a, 1, seed=5)  # the first inner step of round 6 at each
        _train(*b, 1, seed=6)
        assert b[0].inner_steps == a[0].inner_steps == 6 * H + 1
        assert b[3].last_epoch == a[3].last_epoch == 6 * H + 1
        assert b[2].param_groups[0]["lr"] == a[2].param_groups[0]["lr"]
        assert _adam_steps(b[2]) == _adam_steps(a[2]) == {6.0 * H + 1}
    finally:
        for s in (a, b):
            if s is not None:
                s[0].close(wait=False)


def test_position_passes_double_up_to_state_pull_timeout() -> None:
    from dtrain.state import POSITION_FIRST_ATTEMPT_S, position_passes

    assert position_passes(8.0, 120.0) == [8.0, 16.0, 32.0, 64.0, 120.0]
    assert position_passes(None, 120.0) == [POSITION_FIRST_ATTEMPT_S, 40.0, 80.0, 120.0]
    assert position_passes(200.0, 120.0) == [120.0]  # one pass of state_pull_timeout_s
    assert position_passes(8.0, 0.0) == [] and position_passes(0.1, 1.0) == [1.0]


def test_a_resync_whose_first_donor_stalls_takes_another_donors_position_without_waiting_for_it() -> None:
    """Three sites; b misses round 2 and resyncs. Its pull of a's training position never
    answers (a stalled stream: on a 30%-loss link one waited 65 s while another donor had the
    same position). Every donor is asked at once, so b takes c's position without waiting for
    a's call to time out: well within the plan's broadcast deadline (10 s here), which the
    donors asked one after another cost first, and before that the whole
    state_pull_timeout_s (120 s)."""
    import time

    from dtrain.rendezvous.deadlines import DeadlineConfig
    from dtrain.transports.inproc import FaultRule

    net = InprocNetwork()
    core = RendezvousCore(
        RendezvousConfig(min_sites=1, quorum_timeout_s=0.5, deadlines=DeadlineConfig(stall_budget_s=2.5))
    )
    sites = []
    try:
        for name in ("a", "b", "c"):
            sites.append(_site(name, net, core))
        a, b, c = sites
        _lockstep([a, b, c], 2 * H)  # rounds 0 and 1 with all three
        assert a[0].round == b[0].round == c[0].round == 2
        _lockstep([a, c], H)  # round 2 without b (cut at the 0.5 s quorum timeout)
        assert a[0].round == c[0].round == 3 and b[0].round == 2
        stalled = a[0].engine.transport.address
        net.add_rule(FaultRule(kind="pull_state", sender="b", dst=stalled, bucket=len(a[0].state), action="cut"))
        t0 = time.monotonic()
        _train(*b, H, seed=4)
        took_s = time.monotonic() - t0
        assert b[0].last_outcome.status.value == "resynced" and b[0].round == 3
        assert b[0].healed_from == "c", b[0].healed_from
        assert b[0].inner_steps == c[0].inner_steps == 3 * H
        assert _adam_steps(b[2]) == _adam_steps(c[2]) == {3.0 * H}
        plan = b[0].site.last_plan
        assert plan is not None and plan.broadcast_timeout_s >= 10.0
        assert took_s < plan.broadcast_timeout_s / 2, (took_s, plan.broadcast_timeout_s)
    finally:
        for s in sites:
            s[0].close(wait=False)
