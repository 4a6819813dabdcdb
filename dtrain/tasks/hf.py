"""The ``hf`` task: any Hugging Face ``transformers`` causal language model, built from a
config, trained on the data of ``dtrain.tasks.data`` (``--task hf --hf.config PATH|preset``).

``TaskSpec.hf.config`` names the model: a preset of :data:`~dtrain.tasks.spec.HF_PRESETS`
(``tiny-llama``, ``small-llama``), a ``config.json``, or a directory holding
``config.json`` and optionally ``model.safetensors`` (initial weights, loaded with
``from_pretrained(local_files_only=True)``). Nothing is downloaded. Without weights the
model is drawn from ``TaskSpec.seed`` inside a forked RNG, so every site starts from
bit-identical weights and the global RNG is untouched. The vocabulary must cover the
tokens: the tokenizer's size, or 256 for bytes (a preset takes it; a config with a smaller
``vocab_size`` is refused).

Training is the built-in task's: the same data mechanism (:func:`dtrain.tasks.builtin.build_data`:
plain text, JSON lines or parquet, bytes or a ``tokenizer.json``, packed fixed-length
windows, per-site shards and data ledger), inner AdamW with weight decay 0.1 on matrices,
the same LR schedule, batch size, context length and learning rate options. A site group
with ``parallel=fsdp`` shards each decoder layer (the ``nn.ModuleList`` of the model,
``dtrain.app.ranks.wrap_model``). ``Task.export_files`` writes ``config.json`` (and the
tokenizer), so an exported directory (``dtrain.app.export``) loads with
``AutoModelForCausalLM.from_pretrained``.

``transformers`` is an optional dependency (``pip install 'dtrain[hf]'``): imported when
the task is built, with an error saying how to install it when it is missing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dtrain.tasks.builtin import build_data, make_optimizer, make_scheduler, task_info
from dtrain.tasks.spec import HF_PRESETS, Task, TaskSpec

__all__ = ["build_task", "hf_loss", "load_config", "INSTALL_HINT"]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'dtrain[hf]' (or: pip install transformers safetensors)"


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"task 'hf' needs the transformers package, which is not installed: {INSTALL_HINT}") from e
    return transformers


def hf_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/token) of a causal LM on ``batch = (x, y)``, both [B, T] int64."""
    x, y = batch
    device = next(model.parameters()).device
    logits = model(input_ids=x.to(device), use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.to(device).reshape(-1))


def load_config(ref: str, *, vocab_size: int) -> tuple[Any, Path | None]:
    """The ``transformers`` config ``ref`` names (see the module docstring) and the
    directory of its weights (None: draw them from the seed).

    Raises:
        ValueError: naming ``hf.config``: not a config transformers can read, or a
            ``vocab_size`` below the tokenizer's ``vocab_size``.
    """
    transformers = _transformers()
    weights = None
    if ref in HF_PRESETS:
        fields = dict(HF_PRESETS[ref])
        cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), vocab_size=vocab_size, **fields)
    else:
        path = Path(ref).expanduser()
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"hf.config: {file}: no such file (a config.json, or a directory holding one)")
        try:
            d = json.loads(file.read_text())
            model_type = d.pop("model_type")
            cfg = transformers.AutoConfig.for_model(model_type, **d)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"hf.config: {file} is not a transformers config.json ({e!r})") from None
        if cfg.vocab_size < vocab_size:
            raise ValueError(
                f"hf.config: {file} has vocab_size={cfg.vocab_size}, fewer than the tokens' {vocab_size} "
                "(tokenizer, or 256 bytes without one)"
            )
        if path.is_dir() and (path / "model.safetensors").is_file():
            weights = path
    cfg.use_cache = False
    return cfg, weights


def _model(cfg: Any, weights: Path | None, seed: int) -> torch.nn.Module:
    """The causal LM of ``cfg``: from ``weights`` when given, else drawn from ``seed``
    (fp32, under a forked global RNG)."""
    transformers = _transformers()
    if weights is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            weights, config=cfg, local_files_only=True, dtype=torch.float32
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def build_task(spec: TaskSpec) -> Task:
    """Build the ``hf`` task for one site (see the module docstring).

    Raises:
        ValueError: naming ``hf.config`` (none given, not readable, vocabulary too small,
            transformers missing) or the data fields of :func:`dtrain.tasks.builtin.build_data`.
    """
    if spec.hf.config is None:
        raise ValueError(
            "hf.config: task 'hf' needs a model: --hf.config PATH|preset (presets: tiny-llama, small-llama)"
        )
    t0 = time.perf_counter()
    _transformers()  # the install hint before the data is read
    data = build_data(spec, hf_loss)
    cfg, weights = load_config(spec.hf.config, vocab_size=data.tokenizer.vocab_size)
    if data.context_len > getattr(cfg, "max_position_embeddings", data.context_len):
        raise ValueError(
            f"context_len: {data.context_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
        )
    model = _model(cfg, weights, spec.seed)
    model.train()
    optimizer = make_optimizer(model, spec.resolved_lr)
    scheduler = make_scheduler(optimizer, spec)
    num_params = sum(p.numel() for p in model.parameters())
    info = task_info(spec, data, num_params, build_s=time.perf_counter() - t0, task=f"hf:{cfg.model_type}")
    info["hf_config"] = spec.hf.config
    logger.info("built task: %s", info)

    def export_files(directory: Path) -> None:
        """config.json (``save_pretrained``'s) and the tokenizer beside the weights."""
        cfg.save_pretrained(directory)
        data.copy_tokenizer(directory)

    return Task(
        model=model,
        optimizer=optimizer,
        batches=data.batches,
        loss=hf_loss,
        evaluate=data.evaluate,
        tokens_per_batch=data.batch_size * data.context_len,
        info=info,
        scheduler=scheduler,
        shard_part=data.shard_part,
        export_files=export_files,
    )
