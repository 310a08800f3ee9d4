"""Applying a multi-GPU strategy to a model with PyTorch's own code (DDP, FSDP2, HSDP, DTensor
tensor-parallel plans) and counting what it holds (the sharded step's memory tracker). One copy,
used by plan (on a fake process group), probe (under torchrun) and ElasticStep."""
