"""torchtitan's own Llama 3 and ``parallelize_llama`` as a Workload (the ``[torchtitan]`` extra).

``torchtitan_workload(job)`` builds, from a :class:`~batchfit.zoo.torchtitan_job.TitanJob`:

- the model: torchtitan's ``Transformer`` from ``get_train_spec(name).model_args[flavor]``, updated
  from the job as torchtitan's trainer does (``args.update_from_config(job_config)``: seq_len);
- the batch: ``local_batch_size x seq_len`` token ids and labels, as torchtitan's dataloader gives;
- the loss: torchtitan's ``cross_entropy_loss`` (sum over tokens, in fp32) divided by the token
  count, under torchtitan's ``maybe_enable_amp``: autocast only where neither FSDP nor TP is on
  (FSDP2's mixed-precision policy casts otherwise);
- the optimizer: AdamW / Adam with the job's eps, weight_decay and implementation (fused /
  foreach / for-loop), the keyword arguments torchtitan's ``build_optimizers`` passes;
- ``parallelize_all``: torchtitan's ``parallelize_llama(model, parallel_dims, job_config)`` with
  a ``ParallelDims`` built on ``plan``'s fake process group: TP (``apply_tp``), activation
  checkpointing (``apply_ac``), FSDP2 / HSDP (``apply_fsdp``), exactly as torchtitan calls it.
  ``[compile]`` is left to batchfit's compiled trace (``--compile``), so ``parallelize_llama`` runs
  with compile off; float8 is batchfit's (torchao's ``convert_to_float8_training``, the function
  torchtitan's float8 converter calls), applied before, as torchtitan converts before it parallelizes.

torchtitan 0.2.2's ``torchtitan.models.moe`` imports Triton at import time (a GPU kernel for MoE
token permutation, ``moe/kernels.py``); Llama 3 has no experts and never calls it, and Triton is a
1 GB wheel that CPU builds of torch do without. Where Triton is missing, that one module is given
a stand-in whose functions raise if called (:func:`_import_torchtitan`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import types
from typing import TYPE_CHECKING

from batchfit.errors import ModelSpecError, OptionError
from batchfit.workload import Workload
from batchfit.zoo.torchtitan_job import TORCHTITAN_VERSION, TitanJob

if TYPE_CHECKING:
    from torch import nn

_KERNELS = "torchtitan.models.moe.kernels"


def _import_torchtitan():
    """torchtitan's modules this front door calls, importable without Triton (see the module docstring)."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        raise ModelSpecError(f"torchtitan:FILE needs torchtitan {TORCHTITAN_VERSION}: "
                             "pip install 'batchfit[torchtitan]'")
    version = _dist_version()
    if version is not None and not version.startswith("0.2."):
        raise ModelSpecError(f"torchtitan {version} is installed; torchtitan:FILE reads torchtitan 0.2.x job files "
                             f"(.toml): pip install torchtitan=={TORCHTITAN_VERSION}")
    if _KERNELS not in sys.modules and importlib.util.find_spec("triton") is None:
        stand_in = types.ModuleType(_KERNELS)

        def _needs_triton(*args, **kwargs):
            raise RuntimeError("torchtitan's MoE permutation kernel needs Triton (batchfit traces Llama 3 without it)")

        stand_in.generate_permute_indices = stand_in.fill_indices_wrapper = _needs_triton
        sys.modules[_KERNELS] = stand_in
    logging.getLogger("torchtitan").setLevel(logging.ERROR)  # its info lines would interleave with plan's
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        import torchtitan.models.llama3  # noqa: F401 - registers the train spec
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.config import ConfigManager, JobConfig
        from torchtitan.protocols.train_spec import get_train_spec
        from torchtitan.tools.logging import logger
    except ImportError as error:
        raise ModelSpecError(f"torchtitan {version} cannot be imported ({error}): pip install "
                             f"'batchfit[torchtitan]' (torchtitan=={TORCHTITAN_VERSION})") from None
    logger.setLevel(logging.ERROR)
    return types.SimpleNamespace(parallel_dims=parallel_dims_module, cross_entropy_loss=cross_entropy_loss,
                                 ConfigManager=ConfigManager, JobConfig=JobConfig, get_train_spec=get_train_spec)


def _dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return None


def job_config(job: TitanJob, *, strategy=None):
    """torchtitan's ``JobConfig`` of ``job`` (its own dataclasses, filled from the toml as its
    ``ConfigManager`` does), with compile off (batchfit traces it) and, for ``strategy``, the
    parallel degrees of the strategy being traced."""
    titan = _import_torchtitan()
    data = copy.deepcopy(job.data)
    data.setdefault("compile", {})["enable"] = False
    if strategy is not None:
        parallelism = data.setdefault("parallelism", {})
        replicate = strategy.replicas if strategy.shard == "hsdp" else 1
        parallelism["data_parallel_replicate_degree"] = replicate
        parallelism["data_parallel_shard_degree"] = strategy.dp // replicate
        parallelism["tensor_parallel_degree"] = strategy.tp
        if strategy.shard == "fsdp-noreshard":  # FSDP2's reshard_after_forward=False, as torchtitan names it
            parallelism["fsdp_reshard_after_forward"] = "never"
    try:
        return titan.ConfigManager()._dict_to_dataclass(titan.JobConfig, data)
    except (TypeError, ValueError) as error:
        raise ModelSpecError(f"{job.path}: torchtitan rejects it: {str(error).splitlines()[0]}") from None


def _parallel_dims(strategy):
    """torchtitan's ``ParallelDims`` for ``strategy``, its meshes built on the process group now
    open (plan's fake one). torchtitan picks its mesh device from the machine (``cuda`` unless
    another accelerator is found); on this CPU the meshes are built on ``cpu``, as a gloo run's are."""
    parallel_dims_module = _import_torchtitan().parallel_dims
    replicate = strategy.replicas if strategy.shard == "hsdp" else 1
    dims = parallel_dims_module.ParallelDims(dp_replicate=replicate, dp_shard=strategy.dp // replicate, cp=1,
                                             tp=strategy.tp, pp=1, ep=1, etp=1, world_size=strategy.world_size)
    saved = parallel_dims_module.device_type
    parallel_dims_module.device_type = "cpu"
    try:
        dims.build_mesh()
    finally:
        parallel_dims_module.device_type = saved
    return dims


def _mixed_precision_context(model: nn.Module):
    """torchtitan's ``maybe_enable_amp`` (torchtitan/distributed/utils.py): under FSDP (or TP)
    autocast is off, FSDP2's policy casts; on one GPU the step's own autocast stays."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters()):
        return torch.autocast("cpu", enabled=False)  # the tracer's CUDA autocast mirror acts only under CPU autocast
    return contextlib.nullcontext()


def torchtitan_workload(job: TitanJob, seq_len: int | None = None) -> Workload:
    """The Workload of ``job`` built with torchtitan's own code (see the module docstring)."""
    titan = _import_torchtitan()
    import torch

    cross_entropy_loss = titan.cross_entropy_loss
    spec = titan.get_train_spec(job.model)
    config = job_config(job)
    if seq_len is not None:
        config.training.seq_len = seq_len
    tokens = config.training.seq_len
    args = copy.deepcopy(spec.model_args[job.flavor])
    args.update_from_config(config)
    vocab = args.vocab_size

    def build_model() -> nn.Module:
        return spec.model_cls(args)

    def make_batch(batch_size: int, device: torch.device):
        ids = torch.randint(0, vocab, (batch_size, tokens + 1), device=device)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        inputs, labels = batch
        with _mixed_precision_context(model):
            pred = model(inputs)
            return cross_entropy_loss(pred, labels) / labels.numel()

    optimizer_config = config.optimizer
    optimizer_class = getattr(torch.optim, optimizer_config.name)

    def build_optimizer(params):
        implementation = optimizer_config.implementation
        return optimizer_class(params, lr=optimizer_config.lr, betas=(optimizer_config.beta1, optimizer_config.beta2),
                               eps=optimizer_config.eps, weight_decay=optimizer_config.weight_decay,
                               fused=implementation == "fused", foreach=implementation == "foreach")

    def parallelize_all(model: nn.Module, strategy, groups: dict) -> nn.Module:
        if strategy.shard not in ("none", "fsdp", "fsdp-noreshard", "hsdp") or strategy.pp > 1 or \
                getattr(strategy, "cp", 1) > 1 or getattr(strategy, "ep", 1) > 1:
            raise OptionError(f"{strategy.name} on a torchtitan job: batchfit runs torchtitan's parallelize_llama "
                              "with FSDP2 / HSDP / TP only; use `strategies` fsdp, hsdp<R>, fsdp+tp<N> or tp<N>")
        dims = _parallel_dims(strategy)
        model = spec.parallelize_fn(model, dims, job_config(job, strategy=strategy))
        for name, mesh in dims._meshes.items():
            if mesh.size() > 1 and name in ("tp", "fsdp", "dp_replicate"):
                for group in mesh.get_all_groups():
                    groups[group.group_name] = ("tp" if name == "tp" else "dp", group.size())
        if strategy.tp > 1:
            model.batchfit_tp_loss = "gathered" if config.parallelism.disable_loss_parallel else "sharded"
        return model

    params = sum(p.numel() for p in torch.nn.Module.parameters(_meta_model(spec, args)))
    return Workload(
        name=f"torchtitan:{job.path.name}",
        build_model=build_model, make_batch=make_batch, loss_fn=loss_fn, build_optimizer=build_optimizer,
        tokens_per_sample=tokens, parallelize_all=parallelize_all,
        description=(f"torchtitan {job.model} {job.flavor} ({params / 1e6:,.1f}M parameters, dim {args.dim}, "
                     f"{args.n_layers} layers, vocab {vocab:,}), seq {tokens}: torchtitan's own model and "
                     "parallelize_llama"))


def _meta_model(spec, args):
    import torch

    with torch.device("meta"):
        return spec.model_cls(args)
