"""Tracing a training step on fake tensors: memory tracker, CUDA mirrors, curve fit."""
