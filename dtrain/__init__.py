"""dtrain: decentralized DiLoCo-style training over unreliable networks.

Library entry points: :class:`DiLoCo` and :class:`DiLoCoConfig`.
"""

from dtrain.diloco import DiLoCo, DiLoCoConfig

__version__ = "0.1.0"
__all__ = ["DiLoCo", "DiLoCoConfig", "__version__"]
