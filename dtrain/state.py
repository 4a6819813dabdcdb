"""Global parameters θ per bucket, their outer optimizers and residuals, and what state
transfer moves: one bucket's state (repair of stale buckets; a site catching up pulls and
replays them, :mod:`dtrain.rounds.catchup`) and a site's training position.

Every site keeps θ as one fp32 tensor per bucket, one outer optimizer per
bucket (so its state is per bucket and can be repaired or transferred bucket by
bucket), and one error-feedback residual per bucket (docs/ARCHITECTURE.md, "One round").
"""

from __future__ import annotations

import copy
import hashlib
import io
import logging
import threading
from typing import Any, Callable, Sequence

import torch

from dtrain.buckets import BucketLayout, checksum
from dtrain.codecs.base import CheckedRun
from dtrain.codecs.native import SgdStep, sgd_width
from dtrain.errors import StateTransferError
from dtrain.protocol import BucketState

__all__ = [
    "OuterOptimizerFactory",
    "default_outer_optimizer",
    "outer_sgd",
    "delayed_outer_optimizer",
    "DELAYED_OUTER_MOMENTUM",
    "GlobalState",
    "position_state",
    "position_passes",
    "POSITION_FIRST_ATTEMPT_S",
    "decode_position",
    "copy_reusing",
    "theta_device_of",
]

log = logging.getLogger(__name__)

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def outer_sgd(params: list[torch.Tensor], *, lr: float, momentum: float, nesterov: bool) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` as every built-in outer optimizer makes it: torch's fused kernel
    (``fused=True``: one pass over θ, the gradient and the momentum buffer, ~3x less CPU than
    the per-op path) where every parameter is a plain float32 CPU tensor; torch's default path
    otherwise (a device θ, a DTensor, a torch without a fused CPU SGD).

    The fused kernel gives the per-op path's bits except in each tensor's last ``n % 32``
    elements, which it rounds differently (an ulp): a bucket's θ must therefore be stepped as
    the same tensor shape on every site, which it is (one layout per run, the same
    ``--ranks-per-site`` on every site, both checked at join); torch's thread count does not
    change the result (tests/unit/test_round_cpu_paths.py)."""
    params = list(params)
    cpu = bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type == "cpu" and p.dtype == torch.float32
        for p in params
    )
    if cpu:
        try:
            return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, fused=True)
        except RuntimeError:  # torch before 2.4 has the fused kernel on CUDA only
            pass
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)


def _step_in_one_pass(opt: torch.optim.Optimizer, theta: torch.Tensor, run: CheckedRun) -> bool:
    """``opt.step()`` with ``run``'s values as ``theta``'s gradient, the decode in the step's own
    pass (``Kernels.decode_sgd``: one read of θ and its momentum, no gradient tensor written and
    read back), where that gives exactly torch's bits: ``opt`` is :func:`outer_sgd`'s fused SGD
    (momentum, not maximize, a float lr) over ``theta`` alone, a contiguous float32 CPU tensor,
    with no step hooks (:func:`_step_hooked`), and :func:`~dtrain.codecs.native.sgd_width` found
    this torch's kernel here. Its state is kept as torch's step keeps it (the momentum buffer
    made at the first step). False (nothing done): the caller decodes and steps."""
    if type(opt) is not torch.optim.SGD or len(opt.param_groups) != 1:
        return False
    g = opt.param_groups[0]
    if not g.get("fused") or g["maximize"] or g.get("differentiable") or g["momentum"] == 0:
        return False
    if len(g["params"]) != 1 or g["params"][0] is not theta or type(g["lr"]) is not float:
        return False
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        return False
    if _step_hooked(opt):  # a hook may read the gradient, which this step never materializes
        return False
    if theta.device.type != "cpu" or theta.dtype != torch.float32 or not theta.is_contiguous():
        return False
    width = sgd_width()
    if width is None:
        return False
    buf = opt.state[theta].get("momentum_buffer")
    first = buf is None
    if first:
        buf = torch.empty_like(theta, memory_format=torch.contiguous_format)
    elif not (buf.dtype == torch.float32 and buf.device.type == "cpu" and buf.is_contiguous()):
        return False
    step = SgdStep(
        theta.numel(), g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"], first, width
    )
    with torch.no_grad():
        if not run.step_sgd(theta.detach(), buf, step):
            return False
    torch.autograd.graph.increment_version(theta)  # written through its pointer: as an in-place op would
    if first:
        opt.state[theta]["momentum_buffer"] = buf
    if getattr(opt.step, "_wrapped_by_lr_sched", False):
        opt._opt_called = True  # what the LR scheduler's wrapper of opt.step records (its order check)
    return True


def _step_hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` would run more than SGD's arithmetic: step hooks of ``opt`` or of
    every optimizer (``register_optimizer_step_*_hook``), or a wrapper of its ``step`` other
    than an LR scheduler's (which only records the call)."""
    from torch.optim import optimizer as _o  # the global hooks' registries

    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return True
    if getattr(_o, "_global_optimizer_pre_hooks", None) or getattr(_o, "_global_optimizer_post_hooks", None):
        return True
    wrapped = opt.__dict__.get("step")
    return wrapped is not None and not getattr(wrapped, "_wrapped_by_lr_sched", False)


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov
    (Douillard et al., arXiv 2311.08105, §3 / Table 5, "outer optimizer")."""
    return outer_sgd(params, lr=0.7, momentum=0.9, nesterov=True)


def theta_device_of(tensors: Sequence[torch.Tensor], mode: str) -> torch.device:
    """Where θ lives for ``DiLoCoConfig.theta_device`` ``mode``: the CPU for ``"cpu"``;
    for ``"model"`` the device of the first tensor (a DTensor's local shard's), CPU
    when there is none.

    Raises:
        ValueError: ``mode`` is neither, or the tensors sit on several devices.
    """
    if mode == "cpu" or not tensors:
        if mode not in ("cpu", "model"):
            raise ValueError(f"theta_device must be 'cpu' or 'model', got {mode!r}")
        return torch.device("cpu")
    if mode != "model":
        raise ValueError(f"theta_device must be 'cpu' or 'model', got {mode!r}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"theta_device='model' needs the model on one device, found {sorted(map(str, devices))}")
    return next(iter(devices))


#: The one-step-delayed mode's outer momentum (F = 1, τ = H): its Δ is one round stale, and at
#: DiLoCo's 0.9 the outer step is unstable; 0.7 was the best of a sweep with the eager merge
#: (experiments/delayed_momentum.py, experiments/RESULTS.md "One-step-delayed rounds").
DELAYED_OUTER_MOMENTUM = 0.7


def delayed_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer of the one-step-delayed mode: SGD, lr 0.7, Nesterov momentum
    :data:`DELAYED_OUTER_MOMENTUM` (DiLoCo's, with the momentum lowered for a stale Δ)."""
    return outer_sgd(params, lr=0.7, momentum=DELAYED_OUTER_MOMENTUM, nesterov=True)


def _buffer_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    # θ ← θ − 1·mean(Δ) = mean of the sites' local buffers: plain averaging.
    return outer_sgd(params, lr=1.0, momentum=0.0, nesterov=False)


def _serialize(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deserialize(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)


class GlobalState:
    """θ, outer optimizers and residuals of one site, bucket by bucket.

    Args:
        layout: the bucket layout of the synchronised tensors.
        tensors: the model tensors θ starts from (copied to fp32).
        outer_optimizer: factory building the outer optimizer over ``[θ_b]``
            for each parameter bucket (buffer buckets always use plain averaging).
        device: where θ, the outer-optimizer state and the residuals live
            (default CPU; ``DiLoCoConfig.theta_device = "model"`` passes the model's
            device). Means decoded on the host are moved there before the outer
            step; checksums and state transfers copy θ_b to the host.

    Thread-safety: each bucket has its own lock (``lock(b)``); the round engine
    applies a bucket's mean under it while peers may read it for repair.

    θ_b changes only through :meth:`apply_mean`, :meth:`load_bucket` and
    :meth:`load_state_dict`; its checksum is cached between them (hashing θ costs
    ~3 ns per element, and a round asks for it before, after and for the metrics).
    Code that writes ``theta[b]`` in place otherwise calls :meth:`invalidate_checksums`.
    """

    def __init__(
        self,
        layout: BucketLayout,
        tensors: Sequence[torch.Tensor],
        outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.theta: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.residuals: list[torch.Tensor | None] = [None] * len(layout)
        # bucket_round[b]: number of rounds whose outcome θ_b reflects.
        self.bucket_round: list[int] = [0] * len(layout)
        self.rounds_applied = 0
        self._locks = [threading.RLock() for _ in range(len(layout))]
        self._sums: list[str | None] = [None] * len(layout)  # checksum(θ_b) until θ_b changes
        for b in layout.buckets:
            out = torch.empty(b.numel, dtype=torch.float32, device=self.device)
            t = layout.gather(b.index, tensors, out=out).requires_grad_(True)
            self.theta.append(t)
            factory = outer_optimizer if b.kind == "param" else _buffer_outer_optimizer
            opt = factory([t])
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
            self.optimizers.append(opt)

    def __len__(self) -> int:
        return len(self.theta)

    def lock(self, b: int) -> threading.RLock:
        return self._locks[b]

    def checksum(self, b: int) -> str:
        """blake2b-128 of θ_b's bytes (cached until θ_b changes)."""
        with self._locks[b]:
            s = self._sums[b]
            if s is None:
                s = self._sums[b] = checksum(self.theta[b])
            return s

    def invalidate_checksums(self) -> None:
        """Forget the cached checksums (after writing θ other than through this class)."""
        for b in range(len(self)):
            with self._locks[b]:
                self._sums[b] = None

    def checksums(self) -> list[str]:
        return [self.checksum(b) for b in range(len(self))]

    def apply_mean(self, b: int, mean: torch.Tensor | CheckedRun) -> str:
        """Run the outer optimizer on bucket ``b`` with ``mean`` as the gradient.

        Args:
            mean: fp32 ``[numel_b]``, the decoded mean pseudo-gradient, or its payloads checked
                and not yet decoded (a :class:`~dtrain.codecs.base.CheckedRun`): where the outer
                optimizer is torch's fused SGD on a CPU θ_b, decoded in the step's own pass with
                the bits torch's step gives (:func:`_step_in_one_pass`); else decoded first.
        Returns:
            checksum of θ_b after the step.
        """
        with self._locks[b]:
            self._step(b, mean)
            s = self._sums[b] = checksum(self.theta[b])
            return s

    def _step(self, b: int, mean: torch.Tensor | CheckedRun) -> None:
        """:meth:`apply_mean` less the checksum (the caller holds bucket ``b``'s lock)."""
        t = self.theta[b]
        self._sums[b] = None
        if not (isinstance(mean, CheckedRun) and _step_in_one_pass(self.optimizers[b], t, mean)):
            t.grad = (mean.tensor() if isinstance(mean, CheckedRun) else mean).to(t.device)
            self.optimizers[b].step()
            t.grad = None

    def snapshot_bucket(self, b: int) -> tuple[torch.Tensor, dict, str]:
        """A copy of bucket ``b`` (θ_b, its outer-optimizer state, its checksum) for
        :meth:`restore_bucket`: what an owner keeps while its applied mean is not yet
        committed (``dtrain.rounds.pulls.MeanPulls.settle``). Costs a copy of θ_b and of
        its optimizer state (e.g. Nesterov's momentum buffer), on θ's device."""
        with self._locks[b]:
            theta = self.theta[b].detach().clone()
            opt = copy.deepcopy(self.optimizers[b].state_dict())
            return theta, opt, self.checksum(b)

    def restore_bucket(self, b: int, snapshot: tuple[torch.Tensor, dict, str]) -> None:
        """Put bucket ``b`` back as :meth:`snapshot_bucket` copied it (θ_b and optimizer
        state; ``bucket_round`` and the residual are left as they are)."""
        theta, opt, digest = snapshot
        with self._locks[b]:
            with torch.no_grad():
                self.theta[b].copy_(theta)
            self.optimizers[b].load_state_dict(opt)
            self._sums[b] = digest

    def bucket_state(self, b: int) -> BucketState:
        """Snapshot of bucket ``b`` (θ_b bytes and outer-optimizer state)."""
        with self._locks[b]:
            theta = self.theta[b].detach().cpu().clone()
            opt = _serialize(self.optimizers[b].state_dict())
            rnd = self.bucket_round[b]
            digest = self.checksum(b)
        return BucketState(
            bucket=b,
            rounds_applied=rnd,
            theta=theta.numpy().tobytes(),
            optimizer_state=opt,
            checksum=digest,
        )

    def decode_bucket_state(self, st: BucketState) -> tuple[torch.Tensor, dict]:
        """Validate and decode a peer's bucket state without applying it.

        Raises:
            StateTransferError: wrong bucket, length, checksum or optimizer state.
        """
        if not 0 <= st.bucket < len(self):
            raise StateTransferError(f"bucket {st.bucket} out of range [0, {len(self)})")
        numel = self.layout.buckets[st.bucket].numel
        if len(st.theta) != 4 * numel:
            raise StateTransferError(f"bucket {st.bucket}: theta has {len(st.theta)} bytes, expected {4 * numel}")
        theta = torch.frombuffer(bytearray(st.theta), dtype=torch.float32)
        if checksum(theta) != st.checksum:
            raise StateTransferError(f"bucket {st.bucket}: theta checksum mismatch (corrupt transfer)")
        try:
            opt = _deserialize(st.optimizer_state)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad transfer
            raise StateTransferError(f"bucket {st.bucket}: unreadable optimizer state: {e}") from e
        if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
            raise StateTransferError(f"bucket {st.bucket}: optimizer state is not an optimizer state_dict")
        return theta, opt

    def load_bucket(self, b: int, theta: torch.Tensor, opt_state: dict, rounds_applied: int) -> None:
        """Install a decoded bucket (see :meth:`decode_bucket_state`)."""
        with self._locks[b]:
            self._sums[b] = None
            with torch.no_grad():
                self.theta[b].copy_(theta)
            self.optimizers[b].load_state_dict(opt_state)
            self.bucket_round[b] = rounds_applied
            self.residuals[b] = None

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        """Reset the model's tensors to θ (docs/ARCHITECTURE.md "One round", step 4)."""
        for b in range(len(self)):
            with self._locks[b]:
                self.layout.scatter(b, self.theta[b].detach(), tensors)

    def state_dict(self) -> dict:
        """θ, outer-optimizer states, residuals and the round number (tensors only).

        Keys (lists have one entry per bucket, see ``layout``):

        - ``theta``: fp32 ``[numel_b]`` tensors, the global parameters θ;
        - ``outer_optimizer``: each bucket's outer-optimizer ``state_dict()``;
        - ``residuals``: fp32 ``[numel_b]`` error-feedback residuals, or None;
        - ``round``: rounds applied to θ (= the next round's number);
        - ``bucket_round``: per bucket, the rounds whose outcome θ_b reflects;
        - ``fingerprint``: the bucket layout's :meth:`BucketLayout.fingerprint`.

        A snapshot: nothing in it is shared with the live state (a torch
        optimizer's own ``state_dict()`` returns its momentum tensors by
        reference, and they are updated in place by later rounds).
        """
        return {
            "theta": [t.detach().clone() for t in self.theta],
            "outer_optimizer": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "residuals": [None if r is None else r.clone() for r in self.residuals],
            "round": self.rounds_applied,
            "bucket_round": list(self.bucket_round),
            "fingerprint": self.layout.fingerprint(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Load :meth:`state_dict` output; refuses a different layout (ValueError).

        Also reads the layout written before the keys were renamed
        (``optimizers`` for ``outer_optimizer``, ``rounds_applied`` for ``round``).
        """
        sd = _renamed(sd)
        if sd.get("fingerprint") != self.layout.fingerprint():
            raise ValueError(
                f"state_dict fingerprint {sd.get('fingerprint')!r} does not match this model's bucket layout "
                f"{self.layout.fingerprint()!r} (different model or bucket_bytes/chunk_bytes)"
            )
        for b in range(len(self)):
            if sd["theta"][b].numel() != self.theta[b].numel():
                raise ValueError(
                    f"state_dict theta[{b}] has {sd['theta'][b].numel()} elements, expected {self.theta[b].numel()}"
                )
        for b in range(len(self)):
            with self._locks[b]:
                self._sums[b] = None
                with torch.no_grad():
                    self.theta[b].copy_(sd["theta"][b])
                # deep copy: Optimizer.load_state_dict keeps the given tensors, and
                # later steps would write into the caller's dict
                self.optimizers[b].load_state_dict(copy.deepcopy(sd["outer_optimizer"][b]))
                r = sd["residuals"][b]
                self.residuals[b] = None if r is None else r.to(self.device, copy=True)
                self.bucket_round[b] = int(sd["bucket_round"][b])
        self.rounds_applied = int(sd["round"])


_OLD_KEYS = {"optimizers": "outer_optimizer", "rounds_applied": "round"}


def copy_reusing(old: Any, new: Any) -> Any:
    """A copy of ``new`` (nested dicts, lists, tuples of tensors and plain values, as an
    optimizer's ``state_dict``) that writes each tensor into ``old``'s tensor at the same
    place when it has the same shape, dtype and device (``copy_``, no allocation), else
    into a fresh clone; other values are deep-copied. ``old``'s reused tensors are
    overwritten: the caller must keep readers of ``old`` out meanwhile."""
    if isinstance(new, torch.Tensor):
        if (
            isinstance(old, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
        ):
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        prev = old if isinstance(old, dict) else {}
        return {k: copy_reusing(prev.get(k), v) for k, v in new.items()}
    if type(new) in (list, tuple):
        prev = old if type(old) is type(new) and len(old) == len(new) else [None] * len(new)
        return type(new)(copy_reusing(a, b) for a, b in zip(prev, new))
    return copy.deepcopy(new)


def position_state(position: dict, *, index: int) -> BucketState:
    """A site's training position (``DiLoCo``: inner step count, inner optimizer and LR
    scheduler states, at the start of round ``position["round"]``) as the
    ``BucketState`` a ``PullState`` of bucket index ``index`` (= the number of buckets,
    one past the last) answers: no θ, the position ``torch.save``-d as the optimizer
    state, its digest as the checksum."""
    data = _serialize(position)
    return BucketState(
        bucket=index,
        rounds_applied=int(position["round"]),
        theta=b"",
        optimizer_state=data,
        checksum=hashlib.blake2b(data, digest_size=16).hexdigest(),
        extra={"position": True},
    )


def decode_position(st: BucketState) -> dict:
    """The position dict of a :func:`position_state` answer.

    Raises:
        StateTransferError: not a position, corrupt, or unreadable.
    """
    if not st.extra.get("position") or st.theta:
        raise StateTransferError(f"bucket {st.bucket}: not a training position")
    if hashlib.blake2b(st.optimizer_state, digest_size=16).hexdigest() != st.checksum:
        raise StateTransferError("training position: checksum mismatch (corrupt transfer)")
    try:
        pos = _deserialize(st.optimizer_state)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad transfer
        raise StateTransferError(f"training position unreadable: {e}") from e
    if not isinstance(pos, dict) or pos.get("round") != st.rounds_applied:
        raise StateTransferError("training position: not a position dict of the round it claims")
    return pos


def _renamed(sd: dict) -> dict:
    """``GlobalState.state_dict`` keys as written now, from either layout."""
    return {_OLD_KEYS.get(k, k): v for k, v in sd.items()}


#: a position pull's first attempt when no plan said how long a round's exchange may take:
#: the broadcast deadline's start bound at the default stall budget (dtrain.rendezvous.deadlines)
POSITION_FIRST_ATTEMPT_S = 20.0


def position_passes(broadcast_timeout_s: float | None, max_attempt_s: float) -> list[float]:
    """The passes of a training-position pull: each pass's timeout, seconds, in order.

    Every donor is asked at once in a pass (``Site.pull_position``); a later pass asks again
    only the donors whose call timed out. The first pass has the last plan's broadcast
    deadline (how long the run's own exchange of a round may take;
    ``POSITION_FIRST_ATTEMPT_S`` before any plan), each later one twice the previous one's,
    up to ``max_attempt_s`` (``GroupConfig.state_pull_timeout_s``); the pass at
    ``max_attempt_s`` is the last. Why: on a lossy link one TCP stream can stall for a minute
    in retransmission back-off (a resync at 30% loss waited 65 s for one donor's position
    while another donor held the same one); a stall now costs a short pass, and a slow but
    moving link still gets the long one. The whole pull takes at most twice
    ``max_attempt_s``, however many donors stall (asked one after another, 20 + 20 + 40 s
    passed at 30% loss before a donor said it was past the round). A pure function: every
    rank of a site group computes the same passes.

    Args:
        broadcast_timeout_s: the last plan's broadcast deadline, seconds (None: no plan yet).
        max_attempt_s: the longest pass, seconds (> 0; otherwise no pass).
    """
    if max_attempt_s <= 0:
        return []
    first = broadcast_timeout_s if broadcast_timeout_s is not None else POSITION_FIRST_ATTEMPT_S
    step = min(max(1.0, first), max_attempt_s)
    out: list[float] = []
    while True:
        out.append(step)
        if step >= max_attempt_s:
            return out
        step = min(2.0 * step, max_attempt_s)
