"""The built-in task: a byte-level GPT (``dtrain.tasks.gpt``) on real text (``dtrain.tasks.data``);
with ``TaskSpec.tokenizer`` its vocabulary is the tokenizer's. :func:`build_data` is the data of
every language-model task (this one and ``dtrain.tasks.hf``).

Presets (``TaskSpec.size``). Step = one inner step (forward, backward, AdamW) at
``torch.set_num_threads(1)``, fp32, eager, on the 2-vCPU development machine, median
over 40-60 steps after 5 warm-up steps (``python experiments/bench_tasks.py``). "idle" was
measured with the machine otherwise idle; "busy" with load average ~14 from other jobs:

========  ==================  =======  ========  ======  ==========  ==========
size      layers/width/heads  params   B x T     lr      step idle   step busy
========  ==================  =======  ========  ======  ==========  ==========
tiny      2 / 64 / 4          0.12 M   8 x 32    2e-3    14 ms       21-27 ms
small     2 / 128 / 4         0.44 M   8 x 64    1e-3    29-37 ms    52-123 ms
base      4 / 256 / 4         3.26 M   16 x 128  5e-4    ~680 ms     ~1070 ms
========  ==================  =======  ========  ======  ==========  ==========

Validation loss (nats/byte, stdlib corpus, one site, 1 thread), step: loss:
tiny 0: 5.42, 100: 2.77, 150: 2.64, 300: 2.51; small 0: 5.44, 200: 2.42, 400: 2.25,
600: 2.13, 1000: 1.95; base 0: 5.37, 50: 2.90, 100: 2.59, 200: 2.30. The learning
rates were picked from short sweeps: tiny 1e-3 / 2e-3 / 3e-3 / 6e-3 gave 2.83 / 2.77
/ 2.78 / 3.01 at step 100 and 2.50 / 2.51 / 2.54 / 2.66 at step 300; small 5e-4 /
1e-3 / 2e-3 / 4e-3 gave 2.02 / 1.95 / 2.24 / 2.33 at step 1000; base 5e-4 / 1e-3
gave 2.30 / 2.50 at step 200.
Three concurrent "small" sites (no sync) on the busy 2-core machine went from 5.44 to
2.46-2.58 in 60 s of training.

Inner optimizer: AdamW (DiLoCo, Douillard et al., arXiv 2311.08105: inner AdamW,
weight decay 0.1), betas (0.9, 0.95) as in nanoGPT; weight decay applies to matrices
and embeddings only, not to biases and LayerNorm gains. Learning rate: constant by
default (the small learning rates here need no warm-up at these sizes);
``lr_schedule="cosine"`` gives linear warmup + cosine decay (``Task.scheduler``, stepped
by the worker after every inner step; its state travels with a joiner's position).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dtrain.tasks.data import (
    BatchStream,
    ByteTokens,
    Corpus,
    FileTokenizer,
    load_corpus,
    load_tokenizer,
    shard_tokens,
    val_batches,
)
from dtrain.tasks.gpt import GPT, GPTConfig
from dtrain.tasks.spec import Task, TaskSpec

__all__ = [
    "build_task",
    "build_data",
    "TaskData",
    "lm_loss",
    "make_optimizer",
    "make_scheduler",
    "warmup_cosine",
    "make_evaluate",
    "task_info",
]

logger = logging.getLogger(__name__)

WEIGHT_DECAY = 0.1  # DiLoCo inner AdamW (arXiv 2311.08105)
BETAS = (0.9, 0.95)


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/token) of ``model`` on ``batch = (x, y)``, both [B, T] int64."""
    x, y = batch
    device = next(model.parameters()).device
    logits = model(x.to(device))  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(device).reshape(-1))


def warmup_cosine(step: int, *, warmup_steps: int, decay_steps: int, floor: float = 0.1) -> float:
    """LR multiplier at inner step ``step``: linear warmup from 1/warmup_steps to 1 over
    ``warmup_steps``, then cosine decay to ``floor`` over ``decay_steps``, then ``floor``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / decay_steps)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def make_scheduler(optimizer: torch.optim.Optimizer, spec: TaskSpec) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The inner LR schedule of ``spec.lr_schedule`` (None for ``"constant"``)."""
    if spec.lr_schedule == "constant":
        return None
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        functools.partial(warmup_cosine, warmup_steps=spec.warmup_steps, decay_steps=spec.decay_steps),
    )


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay 0.1 on tensors with >= 2 dims, none on biases / LayerNorm."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def make_evaluate(batches: list[tuple[torch.Tensor, torch.Tensor]], loss=None):
    """An ``evaluate(model) -> float``: mean ``loss`` (default :func:`lm_loss`) over the fixed ``batches``.

    Runs in eval mode under ``torch.no_grad()`` and puts the model back into the mode
    it was in (also when the forward raises).
    """

    def evaluate(model: torch.nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                total = sum(float((loss or lm_loss)(model, b)) for b in batches)
        finally:
            model.train(was_training)
        return total / len(batches)

    return evaluate


def build_task(spec: TaskSpec) -> Task:
    """Build the built-in GPT task for one site.

    Every site that calls this with the same ``seed``, ``size`` and ``context_len``
    gets a model with bit-identical initial weights; the training shard and data
    order depend on ``site_index`` (see ``dtrain.tasks.data``); the validation batches
    are the same for every site.

    Raises:
        ValueError: naming ``data``, ``non_iid`` or ``context_len`` when the corpus
            cannot be loaded, cannot be sharded as asked, or is too short.
    """
    t0 = time.perf_counter()
    data = build_data(spec, lm_loss)
    model = _gpt(spec, data.context_len, data.tokenizer.vocab_size)
    optimizer = make_optimizer(model, spec.resolved_lr)
    scheduler = make_scheduler(optimizer, spec)
    info = task_info(spec, data, model.num_params(), build_s=time.perf_counter() - t0)
    logger.info("built task: %s", info)

    def export_files(directory: Path) -> None:
        """config.json: the GPT's size (``GPTConfig`` fields) beside its weights."""
        cfg = {"model_type": "dtrain-gpt", **dataclasses.asdict(model.cfg)}
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        data.copy_tokenizer(directory)

    return Task(
        model=model,
        optimizer=optimizer,
        batches=data.batches,
        loss=lm_loss,
        evaluate=data.evaluate,
        tokens_per_batch=data.batch_size * data.context_len,
        info=info,
        scheduler=scheduler,
        shard_part=data.shard_part,
        export_files=export_files,
    )


@dataclass
class TaskData:
    """A language-model task's data for one site (:func:`build_data`): the corpus, the
    tokenizer, this site's packed shard and its batch stream, the evaluation over the
    fixed validation windows, and ``shard_part`` for non-IID re-assignment."""

    corpus: Corpus
    tokenizer: ByteTokens | FileTokenizer
    tokens: torch.Tensor  # [N] this site's shard
    names: list[str]
    batches: BatchStream
    evaluate: Callable[[torch.nn.Module], float]
    shard_part: Callable[[int, int, int, int], BatchStream] | None
    batch_size: int
    context_len: int

    def copy_tokenizer(self, directory: Path) -> None:
        """Copy the tokenizer.json (if any) into an export ``directory``."""
        if isinstance(self.tokenizer, FileTokenizer):
            shutil.copyfile(self.tokenizer.path, directory / "tokenizer.json")


def build_data(spec: TaskSpec, loss: Callable[[torch.nn.Module, Any], torch.Tensor]) -> TaskData:
    """The data of a language-model task for ``spec``'s site (one mechanism for every task
    that reads ``TaskSpec.data``): corpus (any format of ``dtrain.tasks.data``), tokens
    (bytes or ``spec.tokenizer``), this site's shard, its :class:`BatchStream` (seed
    ``seed + site_index``) and an ``evaluate`` of ``loss`` over the fixed validation windows.

    Raises:
        ValueError: naming ``data``, ``text_field``, ``tokenizer``, ``non_iid`` or
            ``context_len`` (missing, empty or malformed files, a corpus too short).
    """
    context_len = spec.resolved_context_len
    batch_size = spec.resolved_batch_size
    corpus = load_corpus(spec.data, text_field=spec.text_field)
    tokenizer = load_tokenizer(spec.tokenizer)
    tokens, names = shard_tokens(
        corpus, site_index=spec.site_index, num_sites=spec.num_sites, non_iid=spec.non_iid, tokenizer=tokenizer
    )
    tok_id = "" if tokenizer.fingerprint == "bytes" else f"/tok{tokenizer.fingerprint}"
    shard_id = (
        f"{corpus.fingerprint}{tok_id}/site{spec.site_index}of{spec.num_sites}/{'non_iid' if spec.non_iid else 'iid'}"
    )
    batches = BatchStream(
        tokens,
        batch_size=batch_size,
        context_len=context_len,
        seed=spec.seed + spec.site_index,
        shard_id=shard_id,
    )
    evaluate = make_evaluate(
        val_batches(
            tokenizer.encode(corpus.val),
            batch_size=batch_size,
            context_len=context_len,
            num_batches=spec.preset.num_val_batches,
        ),
        loss,
    )
    multi_non_iid = spec.non_iid and spec.num_sites > 1
    shard_part = (
        _shard_parts(corpus, spec, tokenizer, batch_size=batch_size, context_len=context_len) if multi_non_iid else None
    )
    return TaskData(corpus, tokenizer, tokens, names, batches, evaluate, shard_part, batch_size, context_len)


def task_info(spec: TaskSpec, data: TaskData, num_params: int, *, build_s: float, task: str = "builtin-gpt") -> dict:
    """``Task.info``: the task's size, corpus, this site's shard and its build time."""
    return {
        "task": task,
        "size": spec.size,
        "num_params": num_params,
        "corpus": data.corpus.name,
        "corpus_fingerprint": data.corpus.fingerprint,
        "train_bytes": data.corpus.train_bytes,
        "val_bytes": len(data.corpus.val),
        "tokenizer": data.tokenizer.fingerprint,
        "vocab_size": data.tokenizer.vocab_size,
        "shard_tokens": int(data.tokens.numel()),
        "shard_files": len(data.names),
        "batch_size": spec.resolved_batch_size,
        "context_len": spec.resolved_context_len,
        "lr": spec.resolved_lr,
        "build_s": round(build_s, 3),
    }


def _gpt(spec: TaskSpec, context_len: int, vocab_size: int = 256) -> GPT:
    """The preset's GPT over ``vocab_size`` tokens (256: bytes), initialized from
    ``spec.seed`` (bit-identical on every site)."""
    preset = spec.preset
    cfg = GPTConfig(
        vocab_size=vocab_size,
        context_len=context_len,
        num_layers=preset.num_layers,
        num_heads=preset.num_heads,
        embed_dim=preset.embed_dim,
    )
    return GPT(cfg, seed=spec.seed)


def _shard_parts(
    corpus: Corpus, spec: TaskSpec, tokenizer, *, batch_size: int, context_len: int
) -> Callable[[int, int, int, int], BatchStream]:
    """``Task.shard_part`` of a non-iid run: streams over parts of any site's shard."""

    def shard_part(index: int, part: int, num_parts: int, since_round: int = 0) -> BatchStream:
        """A stream over part ``part`` of ``num_parts`` of site ``index``'s shard, for the
        adoption made after round ``since_round``: each adoption draws its own windows (its
        generator is seeded by all four), so a shard adopted again never repeats a window an
        earlier adoption drew (0: a checkpoint from before adoptions had a round)."""
        other, _ = shard_tokens(corpus, site_index=index, num_sites=spec.num_sites, non_iid=True, tokenizer=tokenizer)
        lo, hi = other.numel() * part // num_parts, other.numel() * (part + 1) // num_parts
        seed, shard_id = spec.seed + 1_000_003 * (index + 1) + part, f"site{index}of{spec.num_sites}"
        shard_id = f"{corpus.fingerprint}/{shard_id}/non_iid/part{part}of{num_parts}"
        if since_round:
            key = f"{index}/{part}/{num_parts}/{since_round}".encode()
            seed = spec.seed + int.from_bytes(hashlib.blake2b(key, digest_size=6).digest(), "big")
            shard_id += f"/after_round{since_round}"
        return BatchStream(
            other[lo:hi].clone() if hi - lo > context_len else other.clone(),
            batch_size=batch_size,
            context_len=context_len,
            seed=seed,
            shard_id=shard_id,
        )

    return shard_part
