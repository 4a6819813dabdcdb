"""dtrain: decentralized DiLoCo-style training over unreliable networks.

Library entry points: :class:`DiLoCo` and :class:`DiLoCoConfig` (imported
lazily, so ``dtrain rendezvous`` starts without loading torch).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["DiLoCo", "DiLoCoConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("DiLoCo", "DiLoCoConfig"):
        from dtrain import diloco

        return getattr(diloco, name)
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
