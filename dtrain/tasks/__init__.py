"""Training tasks: what each site trains.

A task function takes a :class:`TaskSpec` (which site this is, how many sites, seed,
data, size) and returns a :class:`Task` (model, inner optimizer, batch stream, loss
and evaluation functions). :func:`build_task` is the built-in one, a small byte-level
GPT on real text; users bring their own with ``--task module:function``. A complete
example (``tests/unit/test_tasks.py`` runs this very text)::

    # mytask.py: linear regression on synthetic data
    import torch
    from dtrain.tasks import Task, TaskSpec

    class Stream:  # batches with a saveable position (generator state + step)
        def __init__(self, seed):
            self.gen, self.step = torch.Generator().manual_seed(seed), 0
        def __iter__(self):
            return self
        def __next__(self):
            self.step += 1
            x = torch.randn(32, 8, generator=self.gen)
            return x, x.sum(dim=1, keepdim=True)
        def state_dict(self):
            return {"rng": self.gen.get_state(), "step": self.step}
        def load_state_dict(self, state):
            self.gen.set_state(state["rng"])
            self.step = state["step"]

    def make(spec: TaskSpec) -> Task:
        torch.manual_seed(spec.seed)  # identical initial weights on every site
        model = torch.nn.Linear(8, 1)
        val = next(Stream(seed=10_000))  # a fixed held-out batch
        def loss(m, batch):
            return torch.nn.functional.mse_loss(m(batch[0]), batch[1])
        def evaluate(m):
            was_training = m.training
            m.eval()
            with torch.no_grad():
                value = float(loss(m, val))
            m.train(was_training)
            return value
        return Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-2),
                    batches=Stream(spec.seed + spec.site_index), loss=loss,
                    evaluate=evaluate, tokens_per_batch=32)

    # dtrain worker --task mytask:make ...

``batches`` must be an iterator with ``state_dict()`` / ``load_state_dict()`` (its
data position goes into checkpoints); ``evaluate(model)`` must return the mean loss on
a fixed held-out set and leave the model in the mode it found it in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from dtrain.tasks.spec import PRESETS, BatchStreamLike, HfSpec, Task, TaskSpec

if TYPE_CHECKING:
    from dtrain.tasks.builtin import build_task
    from dtrain.tasks.data import BatchStream

__all__ = [
    "TaskSpec",
    "HfSpec",
    "Task",
    "BatchStream",
    "BatchStreamLike",
    "PRESETS",
    "build_task",
    "load_task",
]


def __getattr__(name: str) -> Any:
    # The built-in task and its data stream import torch: loaded on first use, so
    # ``TaskSpec`` is importable (and checkable) without torch.
    if name == "build_task":
        return importlib.import_module("dtrain.tasks.builtin").build_task
    if name == "BatchStream":
        return importlib.import_module("dtrain.tasks.data").BatchStream
    raise AttributeError(f"module 'dtrain.tasks' has no attribute {name!r}")


def load_task(ref: str) -> Callable[[TaskSpec], Task]:
    """Resolve a task reference to a task function.

    Args:
        ref: ``""`` for the built-in :func:`build_task`, ``"hf"`` for a ``transformers``
            causal LM (``dtrain.tasks.hf``, needs ``TaskSpec.hf.config``), or
            ``"module:function"`` (``function`` may be a dotted attribute path, e.g.
            ``"pkg.mod:Factory.make"``).

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
        return importlib.import_module("dtrain.tasks.builtin").build_task
    if ref == "hf":
        return importlib.import_module("dtrain.tasks.hf").build_task
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(
            f"task: must be 'module:function' (e.g. 'mytask:make'), 'hf' or '' for the built-in task, got {ref!r}"
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
