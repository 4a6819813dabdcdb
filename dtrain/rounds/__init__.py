"""The round (outer step): its public types and the engine that runs it at one site.

``dtrain.rounds.types`` holds :class:`RoundConfig` and :class:`RoundResult`;
``dtrain.rounds.engine`` holds :class:`RoundEngine`.
"""

from dtrain.rounds.engine import RoundEngine
from dtrain.rounds.types import RoundConfig, RoundResult

__all__ = ["RoundConfig", "RoundResult", "RoundEngine"]
