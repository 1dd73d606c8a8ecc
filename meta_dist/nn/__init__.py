"""Layers, losses and the Sequential container; they know nothing of ranks."""
