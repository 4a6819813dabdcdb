"""Step 2 of a round at a member (a mixin of :class:`~dtrain.rounds.engine.RoundEngine`): this
site's residuals (Δ + what earlier rounds did not deliver) encoded per chunk and pushed to each
bucket's owner, its own buckets accepted locally.

Where the codec settles in place (compiled int8 / int4) and the model is fp32 on the CPU, the
encode happens in the pseudo-gradient's own pass (:meth:`Reduce.add_pseudo_gradient`,
``Codec.accumulate_encode``): the body waits in ``_encoded`` for the next round, which takes it
(:meth:`Reduce._adopt_ahead`) and whose pushes only cut it into payloads. Every body is sent and
settled by that round, or undone exactly (:meth:`Reduce._unsettle_ahead`); docs/DECISIONS.md,
"Round engine CPU".

Uses the engine's ``state``, ``codec``, ``config``, ``transport``, ``site_id``, ``log``,
``fault_hook``, ``_gen``, ``_encoded``, ``accept_own``, ``member_unreachable`` and
``_wait_fanout``; ``run`` is the engine's per-round ``_Run`` (typed ``Any`` here: the engine
imports this module, not the reverse).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Sequence

import torch

from dtrain.errors import PeerUnavailable, TransportError
from dtrain.protocol import Contribution, made
from dtrain.rounds import error_feedback
from dtrain.rounds.fanout import Fanout

__all__ = ["Reduce"]


class Reduce:
    """The reduce step of :class:`~dtrain.rounds.engine.RoundEngine` and the pseudo-gradient
    it sends."""

    def add_pseudo_gradient(self, tensors: list[torch.Tensor], buckets: Sequence[int] | None = None) -> bool:
        """Set residual_b ← β·residual_b + (θ_b − local_b) for every bucket (of ``buckets``),
        β = ``RoundConfig.error_feedback_decay``.

        Args:
            tensors: the model's current (local) tensors, as the layout expects.
            buckets: only these (a fragment round); None: all.
        Returns:
            False, with every residual cleared, when any value is non-finite
            (the site then contributes nothing this round; docs/ARCHITECTURE.md, "The residual rule").
        """
        chosen = range(len(self.state)) if buckets is None else buckets
        self._unsettle_ahead(chosen)  # encoded ahead for a run_round that never came: the residuals as they were
        bodies: dict[int, Any] = {}
        ok = error_feedback.add_pseudo_gradient(
            self.state.layout,
            self.state.theta,
            self.state.residuals,
            tensors,
            error_feedback=self.config.error_feedback,
            buckets=buckets,
            decay=self.config.error_feedback_decay,
            codec=self.codec if self.config.error_feedback and not self.codec.lossless else None,
            encoded=bodies,  # what the codec encoded in the same pass: run_round's pushes cut it
        )
        with self._cv:  # each body with the residual it settled (a residual replaced since has none)
            self._encoded.update((b, (self.state.residuals[b], e)) for b, e in bodies.items())
        if not ok:
            self.log.error("non-finite pseudo-gradient or residual: dropped, this site contributes nothing this round")
        return ok

    def _adopt_ahead(self, run: Any) -> None:
        """The bodies encoded ahead of ``run``'s buckets become the run's to cut and send (a push
        cuts one and registers its payloads and settled residual in one step under ``run.lock``;
        :meth:`_cut_unsent` the ones never pushed). Bodies of other buckets wait for their own
        round (another fragment's)."""
        with self._cv:
            run.encoded = {b: self._encoded.pop(b) for b in run.active if b in self._encoded}

    def _cut_unsent(self, run: Any) -> None:
        """At the close: the payloads of the bodies ``run`` never pushed (owner gone, nothing
        sent), and their residuals registered as settled, which the settle then restores
        exactly (not included). Under ``run.lock``, so a push still cutting a body (given up in
        flight) finishes first."""
        with run.lock:
            ahead, run.encoded = run.encoded, {}
            for b, (v, e) in ahead.items():
                if self.state.residuals[b] is v:
                    self._register_cut(run, b, v, e)

    def _register_cut(self, run: Any, b: int, v: torch.Tensor, body: Any) -> list[bytes]:
        """Bucket ``b``'s payloads cut from ``body``, kept for the settle with ``v`` (the residual
        the body settled) marked settled in place. Under ``run.lock``."""
        payloads = self.codec.encode_chunks(v, self.state.layout.buckets[b].chunks, encoded=body)
        run.payloads.update(((b, c), p) for c, p in enumerate(payloads))
        run.settled[b] = v
        return payloads

    def _unsettle_ahead(self, buckets: Iterable[int]) -> None:
        """Unsettle (exactly) the residuals of ``buckets`` that :meth:`add_pseudo_gradient`
        encoded ahead and no round took, and forget those bodies (a residual replaced since,
        e.g. by a state load, is left alone: its body settled the tensor it replaced)."""
        with self._cv:
            taken = [(b, self._encoded.pop(b)) for b in buckets if b in self._encoded]
        for b, (v, e) in taken:
            if self.state.residuals[b] is v:
                chunks = self.state.layout.buckets[b].chunks
                payloads = self.codec.encode_chunks(v, chunks, encoded=e)
                self.codec.decode_chunks(payloads, [n for _, n in chunks], verify=False, out=v, unsettle=True)

    def _reduce(self, run: Any) -> None:
        """Step 2: encode per chunk and stream to owners (own buckets stay local)."""
        if self.fault_hook is not None:
            self.fault_hook("before_push", run.round)
        if not run.contribute:
            return
        by_owner: dict[str, list[int]] = {}
        for b in run.active:
            by_owner.setdefault(run.owners[b], []).append(b)
        width = max(1, min(8, len(by_owner)))
        fan: Fanout[str, None] = Fanout(lambda o: self._push(run, o, by_owner[o]), by_owner, width, f"push-{run.round}")
        self._wait_fanout(run, fan, run.owned.books.finalize_at, lambda owner: owner, "push")

    def _contributions(self, run: Any, buckets: list[int], remote: bool) -> Iterator[Contribution]:
        """The chunks of ``buckets`` (Δ_b + residual_b encoded), for one owner; they stop at the
        next bucket once that owner is declared lost (its push was given up: :meth:`_wait_fanout`)."""
        first = True
        for b in buckets:
            if remote and run.owners[b] in run.member.unreachable:
                return
            v = self.state.residuals[b]
            if v is None:
                continue
            chunks = self.state.layout.buckets[b].chunks
            t = time.perf_counter()  # one encoding pass per bucket (a datagram run's has ~480 chunks)
            with run.lock:  # encoded and settled by add_pseudo_gradient: cut and registered in one step
                held = run.encoded.pop(b, None)
                cut = held is not None and held[0] is v
                if cut:
                    payloads = self._register_cut(run, b, v, held[1])
            settle = False
            if not cut:
                assert b not in run.settled, f"bucket {b} encoded twice in round {run.round}: its residual was settled"
                settle = self.config.error_feedback and self.codec.settles_in_place(v, chunks)  # see _settle_residuals
                payloads = self.codec.encode_chunks(v, chunks, generator=self._gen, settle=settle)
            # the bucket's counters and kept payloads at once (a lock per chunk cost ~10 µs x 7,650)
            fp32 = 4 * sum(n for _, n in chunks)
            run.add(encode_s=time.perf_counter() - t, encoded_bytes=sum(map(len, payloads)), encoded_fp32_bytes=fp32)
            if not self.codec.lossless and not cut:
                with run.lock:
                    run.payloads.update(((b, c), p) for c, p in enumerate(payloads))
                    if settle:
                        run.settled[b] = v
            for c, ((off, n), payload) in enumerate(zip(chunks, payloads)):
                yield made(  # Contribution(...) without its frozen constructor's cost, per chunk
                    Contribution,
                    round=run.round,
                    bucket=b,
                    chunk=c,
                    offset=off,
                    numel=n,
                    codec=self.codec.name,
                    sender=self.site_id,
                    payload=payload,
                    tokens=run.tokens,
                )
                if remote and first and self.fault_hook is not None:
                    self.fault_hook("mid_push", run.round)
                first = False

    def _push(self, run: Any, owner: str, buckets: list[int]) -> None:
        if owner == self.site_id:  # a bucket's chunks counted in one pass per run (PeerSide.accept_own)
            for b in buckets:
                cs = list(self._contributions(run, [b], remote=False))
                for cn, e in zip(cs, self.accept_own(run.owned, cs)):
                    if e is not None:
                        run.res.errors.append(f"own chunk b{cn.bucket} c{cn.chunk} rejected: {e}")
            return
        t = time.perf_counter()
        pacer, until = run.pacer, run.owned.books.finalize_at
        # a paced round: each chunk waits for its share of the budget (past the reduce deadline: at once)
        paced = {} if pacer is None else {"pace": lambda n: pacer.wait(n, until)}
        try:
            self.transport.push(
                run.plan.address_of(owner),
                self._contributions(run, buckets, remote=True),
                timeout_s=max(0.01, until - time.monotonic()),
                **paced,
            )
        except PeerUnavailable as e:
            run.res.errors.append(f"push to {owner}: {e}")
            self.member_unreachable(run, owner, f"push refused: {e}")
        except TransportError as e:
            run.res.errors.append(f"push to {owner}: {e}")
            self.log.warning("round %d: push to %s failed: %s", run.round, owner, e)
        run.add(network_s=time.perf_counter() - t)
