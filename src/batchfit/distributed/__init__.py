"""Applying a parallel strategy to a model: one copy, used by ``plan`` (rank 0 on the fake
process group), ``probe`` (each rank under torchrun) and the tests' gloo runs.

Importing it does not import torch; wrapping a model does.
"""

from batchfit.distributed.strategy import Meshes, Strategy, apply_strategy, build_meshes, data_parallel, mixed_precision

__all__ = ["Meshes", "Strategy", "apply_strategy", "build_meshes", "data_parallel", "mixed_precision"]
