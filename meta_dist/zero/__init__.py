"""ZeRO data parallelism on flat buffers (Rajbhandari et al., arXiv 1910.02054).

Imports meta_dist.comm (the Communicator interface), meta_dist.nn and meta_dist.optim.
``partition`` is the plan (pure maths), ``flat`` binds a model to flat buffers, and ``stages``
(and ``stage3``) hold one class per ZeRO level; the whole difference between the levels lives there.
``staging`` (the staging buffers) and ``shards`` (owned elements to checkpoints) serve every level.
"""

from meta_dist.zero.flat import FlatModel
from meta_dist.zero.partition import Bucket, Slot, bucket_numel, padded_size, plan
from meta_dist.zero.stage3 import ZeroStage3
from meta_dist.zero.stages import ZeroStage, ZeroStage0, ZeroStage1, ZeroStage2

STAGES: dict[int, type[ZeroStage]] = {0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2,
                                       3: ZeroStage3}

__all__ = ["STAGES", "Bucket", "FlatModel", "Slot", "ZeroStage", "ZeroStage0", "ZeroStage1",
           "ZeroStage2", "ZeroStage3", "bucket_numel", "padded_size", "plan"]
