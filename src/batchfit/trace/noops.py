"""Options that change nothing for the model they are given with, said instead of ignored.

``--routing worst`` on a model without mixture-of-experts layers, or ``--checkpointing every:1000``
on a model of 4 blocks (every:N wraps block i when (i + 1) % N == 0: none of them), trace exactly
the step without the option. Silently, a user reads the answer as the option's; each such option
is one notice line, printed and kept in the result's JSON (``notices``) and report.
"""

from __future__ import annotations

from batchfit.workload import StepOptions, Workload


def no_op_notices(workload: Workload, options: StepOptions) -> list[str]:
    """One line per option in ``options`` that changes nothing for ``workload``'s model (built on the
    meta device: no memory; not built at all when no such option is set)."""
    every = options.checkpointing_spec.every
    if options.routing_spec.kind == "balanced" and not options.routing_schedule.varies and every is None:
        return []
    import torch  # only here: an answer read from the trace cache loads no torch

    from batchfit.trace.routing import moe_experts
    from batchfit.train.model import block_list

    with torch.device("meta"):
        model = workload.build_model()
    notices = []
    if (options.routing_spec.kind != "balanced" or options.routing_schedule.varies) and not moe_experts(model):
        notices.append(f"--routing {options.routing} changes nothing: {workload.name} has no mixture-of-experts "
                       "layers (the routing decides how many tokens each expert gets); drop it")
    blocks = block_list(model)
    if every is not None and blocks is not None and every > len(blocks):
        notices.append(f"--checkpointing {options.checkpointing} changes nothing: {workload.name} has "
                       f"{len(blocks)} blocks and every:{every} checkpoints each {every}-th, none of them; use "
                       f"every:N with N at most {len(blocks)}, or --checkpointing full")
    return notices
