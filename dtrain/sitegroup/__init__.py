"""A site as a torch.distributed group of K ranks: the outer sync sharded across them.

``slices``: which elements each rank syncs (FSDP2 local shards, a 1/K partition of
replicated tensors); ``agree``: the half-round rule and each rank's plan;
``diloco``: :class:`SiteGroupDiLoCo`, the wrapper every rank of a site runs.
"""

from dtrain.sitegroup.agree import RankView, combine_checksums, decide_agreement, rank_donors, rank_plan
from dtrain.sitegroup.diloco import SiteGroupDiLoCo, SiteSyncOutcome, diloco_numel, slice_checksum
from dtrain.sitegroup.slices import SliceMap, is_sharded, local_part

__all__ = [
    "RankView",
    "decide_agreement",
    "rank_plan",
    "rank_donors",
    "combine_checksums",
    "SiteGroupDiLoCo",
    "SiteSyncOutcome",
    "slice_checksum",
    "diloco_numel",
    "SliceMap",
    "is_sharded",
    "local_part",
]
