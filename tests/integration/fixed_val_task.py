"""The built-in GPT task with a validation set that does not depend on the batch size,
for the equivalence rows of ``test_combination_matrix.py`` (``--task
tests.integration.fixed_val_task:build``).

The built-in task evaluates on ``num_val_batches x batch_size`` windows evenly spaced
over the validation text (``dtrain.tasks.data.val_batches``), so a run with batch B and
one with batch 2B are scored on different windows. Here every run is scored on the
same ``VAL_BATCHES x VAL_BATCH_SIZE`` windows, whatever its training batch.
"""

from __future__ import annotations

import dataclasses

from dtrain.tasks.builtin import build_task, make_evaluate
from dtrain.tasks.data import load_corpus, val_batches
from dtrain.tasks.spec import Task, TaskSpec

VAL_BATCHES = 4
VAL_BATCH_SIZE = 16  # windows per validation batch: 64 windows of the tiny preset's 32 bytes


def build(spec: TaskSpec) -> Task:
    """``build_task(spec)`` with its ``evaluate`` over the fixed validation windows."""
    task = build_task(spec)
    batches = val_batches(
        load_corpus(spec.data).val,
        batch_size=VAL_BATCH_SIZE,
        context_len=spec.resolved_context_len,
        num_batches=VAL_BATCHES,
    )
    return dataclasses.replace(task, evaluate=make_evaluate(batches))
