"""Training: datasets, the per-rank sampler and the Trainer that glues everything together."""

from meta_dist.train.build import array_module_for
from meta_dist.train.data import DistributedSampler, load_npz, synthetic_classification
from meta_dist.train.trainer import Trainer

__all__ = ["DistributedSampler", "Trainer", "array_module_for", "load_npz",
           "synthetic_classification"]
