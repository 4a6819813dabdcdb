"""The round (outer step): its public types and the engine that runs it at one site.

Modules:

* ``dtrain.rounds.types`` — :class:`RoundConfig`, :class:`RoundResult`,
  :class:`BucketOutcome` (the state of a bucket after a round), :class:`RejectionTally`;
* ``dtrain.rounds.owner`` — :class:`~dtrain.rounds.owner.OpenRound`, the owner-side
  bookkeeping of one open round (accept, reject, members lost, due, close, finalize);
* ``dtrain.rounds.member`` — :class:`~dtrain.rounds.member.MemberRound`, the member side:
  each bucket's fate in one round (mean arrived or missing, owner lost, its outcome, repaired);
* ``dtrain.rounds.error_feedback`` — the residual arithmetic;
* ``dtrain.rounds.means`` — an owner's mean as broadcast chunks, and back;
* ``dtrain.rounds.engine`` — :class:`RoundEngine`, one site's engine and peer handler,
  whose ``run_round`` is a sequence of named steps;
* ``dtrain.rounds.sitelog`` — the logger adapter that names the site on every line.
"""

from dtrain.rounds.engine import RoundEngine
from dtrain.rounds.types import BucketOutcome, RejectionTally, RoundConfig, RoundResult

__all__ = ["RoundConfig", "RoundResult", "RoundEngine", "BucketOutcome", "RejectionTally"]
