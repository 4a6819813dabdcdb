"""Training tasks: what each site trains.

A task function takes a :class:`TaskSpec` (which site this is, how many sites, seed,
data, size) and returns a :class:`Task` (model, inner optimizer, batch stream, loss
and evaluation functions). :func:`build_task` is the built-in one, a small byte-level
GPT on real text; users bring their own with ``--task module:function``::

    # mytask.py
    from dtrain.tasks import Task, TaskSpec

    def make(spec: TaskSpec) -> Task:
        model = MyNet()                      # same init on every site: seed from spec.seed only
        torch.manual_seed(spec.seed); ...
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        batches = MyStream(shard=spec.site_index, of=spec.num_sites, seed=spec.seed + spec.site_index)
        return Task(model=model, optimizer=opt, batches=batches,
                    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                    evaluate=my_eval, tokens_per_batch=...)

    # dtrain worker --task mytask:make ...

``batches`` must be an iterator with ``state_dict()`` / ``load_state_dict()`` (its
data position goes into checkpoints); ``evaluate(model)`` must return the mean loss on
a fixed held-out set and leave the model in the mode it found it in.
"""

from __future__ import annotations

import importlib
from typing import Callable

from dtrain.tasks.builtin import build_task
from dtrain.tasks.data import BatchStream
from dtrain.tasks.spec import PRESETS, BatchStreamLike, Task, TaskSpec

__all__ = [
    "TaskSpec",
    "Task",
    "BatchStream",
    "BatchStreamLike",
    "PRESETS",
    "build_task",
    "load_task",
]


def load_task(ref: str) -> Callable[[TaskSpec], Task]:
    """Resolve a task reference to a task function.

    Args:
        ref: ``""`` for the built-in :func:`build_task`, or ``"module:function"``
            (``function`` may be a dotted attribute path, e.g. ``"pkg.mod:Factory.make"``).

    Returns:
        The callable; it is not called here.

    Raises:
        ValueError: naming ``task``: the reference has no colon or an empty part, the
            module cannot be imported (the import error is chained), the attribute
            does not exist, or it is not callable.
    """
    if not isinstance(ref, str):
        raise ValueError(f"task: must be 'module:function' or '' for the built-in task, got {ref!r}")
    ref = ref.strip()
    if ref == "":
        return build_task
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(
            f"task: must be 'module:function' (e.g. 'mytask:make') or '' for the built-in task, got {ref!r}"
        )
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module itself failed (SyntaxError, ...)
        raise ValueError(f"task: cannot import module {module_name!r} from {ref!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"task: {module_name!r} has no attribute {attr_path!r} (from {ref!r})") from exc
    if not callable(obj):
        raise ValueError(f"task: {ref!r} is a {type(obj).__name__}, not a callable taking a TaskSpec")
    return obj
