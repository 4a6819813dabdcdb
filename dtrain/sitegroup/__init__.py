"""A site as a torch.distributed group of K ranks: what sits below the one wrapper
(:class:`dtrain.diloco.DiLoCo`, which serves every K) and differs with K.

``slices``: which elements each rank syncs (FSDP2 local shards, a 1/K partition of
replicated tensors); ``agree``: the half-round rule and each rank's plan; ``comm``: the
site's collectives (the identity for K = 1); ``notices``: rank 0's dead-site notices
to the other ranks; ``checkpoint``: a site group's torch.distributed.checkpoint files.
"""

from dtrain.sitegroup.agree import RankView, combine_checksums, decide_agreement, rank_donors, rank_plan
from dtrain.sitegroup.comm import LocalSiteComm, SiteComm, TorchSiteComm
from dtrain.sitegroup.slices import SliceMap, is_sharded, local_part

__all__ = [
    "RankView",
    "decide_agreement",
    "rank_plan",
    "rank_donors",
    "combine_checksums",
    "SiteComm",
    "LocalSiteComm",
    "TorchSiteComm",
    "SliceMap",
    "is_sharded",
    "local_part",
]
