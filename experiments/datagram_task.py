"""A wider built-in GPT for the datagram experiments: about 9.7 M parameters (int8: ~9.8 MB of
pseudo-gradient per site and round, the issue's >= 8 MB), 4 layers of width 448, short windows
so that an inner step stays cheap on a shared machine. Use as ``--task experiments.datagram_task:make``."""

from __future__ import annotations

from dataclasses import replace

from dtrain.tasks.builtin import build_task
from dtrain.tasks.spec import PRESETS, Preset, Task, TaskSpec

PRESETS.setdefault(
    "wide", Preset(num_layers=4, num_heads=8, embed_dim=448, context_len=32, batch_size=2, lr=3e-4, num_val_batches=2)
)


def make(spec: TaskSpec) -> Task:
    """The built-in task with the ``wide`` preset (whatever ``spec.size`` says)."""
    return build_task(replace(spec, size="wide", context_len=None, batch_size=None))
