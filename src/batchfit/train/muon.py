"""``--optimizer muon``: torch.optim.Muon for the hidden 2-D weight matrices, AdamW for the rest.

Muon orthogonalises each update by Newton-Schulz iterations, which needs a matrix, and its
authors train everything that is not a hidden matrix with AdamW: the embeddings, the output
head, norms' gains and biases. Sources: Keller Jordan's reference implementation
(github.com/KellerJordan/Muon, README: ``hidden_weights = [p for p in model.body.parameters()
if p.ndim >= 2]``, the head and embeddings in the AdamW group; ``MuonWithAuxAdam``, one
optimizer with ``use_muon`` parameter groups), and torch.optim.Muon's own docstring
(torch/optim/_muon.py: "Muon is an optimizer for 2D parameters of neural network hidden
layers. Other parameters, such as bias, and embedding, should be optimized by a standard
method such as AdamW").

:class:`MuonWithAdamW` has MuonWithAuxAdam's shape (``use_muon`` groups, so
ZeroRedundancyOptimizer can partition it and build it again per rank) and steps torch's own
Muon and AdamW over its groups. Which parameters are hidden matrices: the 2-D parameters of
every module but ``nn.Embedding`` and the output head (a transformers model's
``get_output_embeddings()``, else the model's last ``nn.Linear``, as in nanoGPT, the zoo LMs
and HF causal LMs; for a classifier, its last layer). A head tied to the embedding is the
embedding's one parameter: AdamW. Convolution kernels (4-D) go to AdamW too: torch.optim.Muon
takes 2-D parameters only (the reference flattens them; torch does not).

Memory: one momentum buffer per Muon parameter (``state["momentum_buffer"]``, its shape and
dtype), AdamW's ``exp_avg`` and ``exp_avg_sq`` (and a scalar ``step``) per other parameter;
Muon's step also makes bf16 temporaries of one matrix at a time (the Newton-Schulz iterations).
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.errors import OptionError

MUON_LR = 0.02
"""Keller Jordan's default for the hidden matrices (memory does not depend on it)."""
ADAMW_LR = 3e-4


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None) or getattr(getattr(model, "module", None),
                                                                  "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        head = next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)), None)
    return head


def hidden_matrices(model: nn.Module, params: list[nn.Parameter]) -> set[int]:
    """ids of the ``params`` Muon trains: 2-D, not in an embedding nor the output head."""
    head = _output_head(model)
    excluded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) or m is head
                for p in m.parameters(recurse=False)}
    wanted = {id(p) for p in params}
    return {id(p) for p in model.parameters() if p.ndim == 2 and id(p) in wanted and id(p) not in excluded}


def muon_optimizer(params: list[nn.Parameter], model: nn.Module | None) -> MuonWithAdamW:
    """Muon for the hidden matrices of ``model`` among ``params``, AdamW for the others."""
    if not hasattr(torch.optim, "Muon"):
        raise OptionError(f"`optimizer` muon needs torch.optim.Muon (torch 2.9 or later; this is torch "
                          f"{torch.__version__}): upgrade torch or pick adamw")
    if model is None:
        raise OptionError("`optimizer` muon splits the model's parameters by module: it needs the model")
    hidden = hidden_matrices(model, params)
    groups = [{"params": [p for p in params if id(p) in hidden], "use_muon": True, "lr": MUON_LR},
              {"params": [p for p in params if id(p) not in hidden], "use_muon": False, "lr": ADAMW_LR}]
    return MuonWithAdamW([g for g in groups if g["params"]])


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over ``use_muon`` parameter groups: torch.optim.Muon steps the groups marked
    True, torch.optim.AdamW the others, both on the same group dicts (a learning rate set here
    is theirs) and one shared ``state``."""

    def __init__(self, params, **defaults) -> None:
        super().__init__(params, defaults)
        self._inner: list[torch.optim.Optimizer] = []
        for use_muon, cls in ((True, torch.optim.Muon), (False, torch.optim.AdamW)):
            groups = [g for g in self.param_groups if bool(g.get("use_muon")) == use_muon]
            if groups:
                inner = cls(groups)
                inner.state = self.state  # one state: the step's memory labels read .state
                self._inner.append(inner)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner:
            inner.step()
        return loss
