"""Model builders: whole networks assembled from meta_dist.nn layers; they know nothing of ranks."""

from meta_dist.models.gpt import gpt

__all__ = ["gpt"]
