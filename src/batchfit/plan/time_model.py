"""Step time, computed (never measured) from what the trace of rank 0 counted.

    compute        = FLOPs rank 0 runs in the step / (the GPU's dense peak for the precision x MFU)
    a collective   = the bytes each rank sends in it / the link's bandwidth (per GPU, per direction)
    step           = compute + max(0, overlapped - compute) + exposed

Bytes a rank sends, for a ring over ``n`` ranks of a ``B``-byte tensor (the full, unsharded
payload the trace records): all-gather and reduce-scatter (n-1)/n x B, all-reduce 2(n-1)/n x B
(a reduce-scatter then an all-gather), broadcast B. This is NCCL's "bus bandwidth" accounting.

The link: ranks fill a node before the next (``world.py``) and the tensor-parallel dimension
is the innermost of the mesh, so a group whose ranks span no more than one node's GPUs talks
over NVLink (or PCIe), and any other over the network between nodes, whose per-GPU adapter
is then the narrowest link of the ring.

What overlaps (the rule the report states):
- FSDP and HSDP prefetch the next block's all-gather, and reduce-scatter the previous block's
  gradients, while a block computes: their data-parallel collectives overlap compute, all but
  the first all-gather of the forward (nothing runs before it).
- DDP all-reduces each gradient bucket as soon as backward fills it: its all-reduces overlap
  the backward, all but the last bucket (nothing computes after it).
- Tensor-parallel collectives sit between two matmuls that wait for them: never overlapped.
- Expert parallelism's all-to-alls (ep<N>: the dispatch before a layer's experts, the combine
  after them) are waited on by the experts and by the next op: never overlapped. An all-to-all
  of B bytes sends (n-1)/n x B (the rows for the rank itself stay); the ep group is inside one
  node while ep <= GPUs per node (torchtitan's sparse mesh: ep consecutive ranks, the tp ones among them).
- Collectives outside forward and backward (in the optimizer step) are not overlapped.
- Context parallelism (cp<N>, group "cp"): per attention layer, the forward all-gathers every
  rank's K/V once (torch's default rotater: (N-1) x the rank's K/V bytes sent, the N-1 ring
  rotations' worth), the backward all-gathers them again and passes dK/dV (fp32) on N times
  (permute_tensor: a rank's whole buffer to its next, factor 1). Ring attention computes one block
  while the next arrives: overlapped, as FSDP's are. The cp group is cp x tp consecutive ranks.
Overlapped communication that takes longer than the compute it hides behind shows as time.

Offload (``--offload activations``): the saved activations go to the host in the forward and
come back in the backward, over the GPU's PCIe host link (``devices.py``, per direction, the
link's signalling rate: a pinned copy reaches 80-90% of it, not taken off here):

    transfer_out = bytes offloaded / host link     (device to host, during the forward)
    transfer_in  = the same bytes / host link      (host to device, during the backward)
    exposed      += max(0, transfer_out - compute/3) + max(0, transfer_in - 2 compute/3)

The assumption: torchtune's side stream overlaps the copies with the compute of their own pass
(the forward taken as a third of the compute, the backward two thirds, the usual 1:2), PCIe is
full duplex and is not shared with the collectives (NVLink or the network carry those); a copy
longer than the pass it hides behind shows as time. Not modelled: the stream's waits (a tensor
asked back before its copy lands stalls the backward; torchtune's heuristics keep that rare).

``--offload params`` (FSDP2's CPUOffloadPolicy): before each all-gather FSDP2 copies the rank's
shard to the GPU (the all-gather's bytes / its group size), and after each reduce-scatter the
gradient shard back; both ride the host link and are prefetched with the collectives, so they
join the overlapped time. Not modelled: the optimizer step, which then runs on the CPU (CPU Adam
over the rank's shard: seconds for billions of parameters), stated as such in every plan.

With gradient accumulation every micro-batch repeats the traced step (FSDP re-gathers its
parameters for each; DDP without ``no_sync`` all-reduces each), so a step of ``k``
micro-batches takes ``k`` times as long: an upper bound for DDP with ``no_sync``.
Pure Python, no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchfit.devices import Device
from batchfit.devices import host_link_seconds as offload_seconds
from batchfit.distributed import parallelisms
from batchfit.errors import OptionError, read_text
from batchfit.plan.world import World

DEFAULT_MFU = 0.4
"""Model FLOPs utilisation assumed when none is given: a round figure for a well-tuned bf16
transformer run on current NVIDIA GPUs (seed 004's FSDP runs of 1-4B models on H100 reached
less, 0.15-0.3). An assumption, printed as one; ``--mfu`` or ``--calibrate bench.json`` replace it."""

DEFAULT_INTRA_NODE_GB_PER_S = 450.0
DEFAULT_INTER_NODE_GB_PER_S = 50.0
"""For a GPU given only by its memory (--gpu-memory): an H100 SXM node's links, said as assumed."""

OVERLAP_RULE = (
    "FSDP/HSDP all-gather the next block's parameters and reduce-scatter the previous block's gradients "
    "while a block computes, and DDP all-reduces each gradient bucket while backward goes on, so "
    "data-parallel collectives overlap compute, except the first all-gather of the forward (FSDP) and the "
    "last gradient bucket (DDP); tensor-parallel collectives sit between matmuls that wait for them and "
    "never overlap; context parallelism's ring (cp) passes the next K/V block while one computes, so it "
    "overlaps too. step = compute + max(0, overlapped - compute) + exposed; with k accumulation steps, "
    "k x that (every micro-batch repeats the traced step's collectives).")


def bus_factor(op: str, ranks: int) -> float:
    """Bytes one rank sends per byte of the full tensor, for a ring over ``ranks`` ranks."""
    if ranks <= 1:
        return 0.0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return 1.0  # broadcast, send/recv: the whole tensor once


@dataclass(frozen=True)
class TimeModel:
    """The assumptions behind every computed time, printed with it."""

    mfu: float = DEFAULT_MFU
    mfu_source: str = f"assumed ({DEFAULT_MFU}, the default; set --mfu or --calibrate)"
    intra_node_gb_per_s: float | None = None
    """Overrides the catalog's within-node figure (--intra-node-gb-per-s)."""
    inter_node_gb_per_s: float | None = None
    """Overrides the catalog's between-node figure (--inter-node-gb-per-s)."""

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise OptionError(f"`mfu` must be in (0, 1], e.g. 0.4; got {self.mfu}")
        for name, value in (("`intra_node_gb_per_s`", self.intra_node_gb_per_s),
                            ("`inter_node_gb_per_s`", self.inter_node_gb_per_s)):
            if value is not None and value <= 0:
                raise OptionError(f"{name} must be more than 0 (GB/s per GPU and direction), e.g. 450; got {value}")

    def links(self, device: Device) -> dict:
        """GB/s within and between nodes, and where each figure comes from."""
        def pick(override, catalog, default, link):
            if override is not None:
                return override, "set by the user"
            if catalog is not None:
                return catalog, f"{link} ({device.source})"
            return default, "assumed (an H100 SXM node's; the GPU was given by its memory only)"

        intra, intra_src = pick(self.intra_node_gb_per_s, device.intra_node_gb_per_s, DEFAULT_INTRA_NODE_GB_PER_S,
                                device.intra_node_link)
        inter, inter_src = pick(self.inter_node_gb_per_s, device.inter_node_gb_per_s, DEFAULT_INTER_NODE_GB_PER_S,
                                device.inter_node_link)
        return {"intra_node_gb_per_s": intra, "intra_node_source": intra_src,
                "inter_node_gb_per_s": inter, "inter_node_source": inter_src}

    def to_json(self) -> dict:
        return asdict(self)


def calibrated(path: str | Path, precision: str) -> TimeModel:
    """A TimeModel whose MFU is the one ``batchfit bench --json`` measured on a GPU: the row
    with the most samples per step that has one (the plan's micro-batches are large ones)."""
    try:
        data = json.loads(read_text(path, f"`calibrate` {path}"))
    except (OSError, json.JSONDecodeError) as error:
        raise OptionError(f"`calibrate` {path}: cannot read it ({error}): give the file "
                          "`batchfit bench --device cuda --json bench.json` wrote") from None
    rows = [r for r in data.get("rows", []) if isinstance(r, dict) and r.get("mfu")] if isinstance(data, dict) else []
    if not rows:
        raise OptionError(f"`calibrate` {path} holds no measured MFU: it must come from a GPU run, "
                          "`batchfit bench MODEL --device cuda --json bench.json`; or give `mfu` 0.4")
    row = max(rows, key=lambda r: r["batch_size"])
    bench_precision = (data.get("options") or {}).get("precision")
    note = "" if bench_precision in (None, precision) else f"; measured at {bench_precision}, planned at {precision}"
    device = (data.get("device") or {}).get("display_name") or (data.get("device") or {}).get("spec", "a GPU")
    return TimeModel(mfu=row["mfu"], mfu_source=f"measured by batchfit bench on {device} at batch "
                                                f"{row['batch_size']} ({Path(path).name}{note})")


@dataclass
class StepTime:
    """One optimizer step's computed time, in its parts."""

    compute_s: float
    """Per micro-batch: FLOPs / (peak x MFU)."""
    communication_s: dict[str, float]
    """Per micro-batch, by group ('dp', 'tp'): every collective's time, overlapped or not."""
    overlapped_s: float
    exposed_s: float
    micro_step_s: float
    accumulation_steps: int
    step_time_s: float
    flops: int
    peak_tflops: float
    bytes_sent: dict[str, int] = field(default_factory=dict)
    """Per micro-batch, by group: bytes rank 0 sends (ring accounting)."""
    links: dict[str, str] = field(default_factory=dict)
    """By group: 'intra-node' or 'inter-node'."""
    offload_transfer_s: float = 0.0
    """Per micro-batch: each direction's host-link time for --offload (bytes / host link)."""
    offload_exposed_s: float = 0.0
    """Per micro-batch: the part of it not hidden behind its pass's compute (in ``micro_step_s``)."""
    pipeline_bubble_s: float = 0.0
    """Per step of a pp<N> strategy: the pipeline's idle time, compute x f / (1 - f), f the idle share of
    torch's schedule played at T_F = T_B = T_W (``pp_schedules.bubble_fraction``): (p-1)/(m+p-1) for GPipe
    and 1F1B, (p-1)/V over m + (p-1)/V interleaved (Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2,
    2.2.1), the ranks' staggered start only, (p-1)/V over 3m + (p-1)/V, for the zero-bubble schedules
    where torch's order reaches ZB-H1's bubble (Qi et al. 2023, arXiv 2401.10241, sec. 2.1) (in
    ``micro_step_s``)."""

    def to_json(self) -> dict:
        return asdict(self)


def group_span(collective, strategy) -> int:
    """How many consecutive ranks one group of ``collective`` spans (tp innermost, then the
    data-parallel shard group, then the replicas)."""
    own = parallelisms.by_group().get(collective.group)  # tp, cp's ring, ep: its own rule (distributed/parallelisms.py)
    if own is not None:
        return own.span(collective, strategy)
    if (strategy.shard == "hsdp" and strategy.replicas > 1 and collective.op != "all_reduce"
            and collective.group_size == strategy.dp // strategy.replicas):
        return collective.group_size * strategy.tp  # the shard group inside one replica
    return strategy.world_size  # dp, and HSDP's all-reduce across the replicas


def wire_bytes(collective) -> float:
    """The bytes ``collective`` puts on a link: its parallelism's own rule (``Parallelism.bus``: cp's dK/dV pass
    sends a rank's whole buffer to the next), else a ring's (:func:`bus_factor`)."""
    own = parallelisms.by_group().get(collective.group)
    factor = own.bus(collective) if own is not None else None
    return (bus_factor(collective.op, collective.group_size) if factor is None else factor) * collective.bytes


def step_time(point, strategy, world: World, device: Device, precision: str, model: TimeModel,
              accumulation_steps: int = 1, param_offload: bool = False) -> StepTime | None:
    """The computed time of one optimizer step of ``accumulation_steps`` micro-batches, each
    the traced ``point``; None when the GPU's peak FLOP/s for ``precision`` is unknown."""
    peak_tflops = device.peak_tflops(precision)
    if not peak_tflops:
        return None
    links = model.links(device)
    compute_s = point.flops / (peak_tflops * 1e12 * model.mfu)
    by_group: dict[str, float] = {}
    sent: dict[str, int] = {}
    link_of: dict[str, str] = {}
    overlapped = exposed = 0.0
    waited = {group for group, parallelism in parallelisms.by_group().items() if parallelism.critical_path}  # tp, ep
    dp_calls = [i for i, c in enumerate(point.collectives) if c.group not in waited]
    first_forward = next((i for i in dp_calls if point.collectives[i].phase == "forward"), None)
    last_backward = next((i for i in reversed(dp_calls) if point.collectives[i].phase == "backward"), None)
    for i, c in enumerate(point.collectives):
        inter = group_span(c, strategy) > world.gpus_per_node
        gb_per_s = links["inter_node_gb_per_s"] if inter else links["intra_node_gb_per_s"]
        nbytes = wire_bytes(c)
        seconds = nbytes / (gb_per_s * 1e9)
        by_group[c.group] = by_group.get(c.group, 0.0) + seconds
        sent[c.group] = sent.get(c.group, 0) + int(nbytes)
        link = "inter-node" if inter else "intra-node"
        link_of[c.group] = link if link_of.get(c.group, link) == link else "intra- and inter-node"  # HSDP
        # TP's collectives and ep's all-to-alls sit on the critical path (the next op waits for them)
        hidden = (c.group not in waited and c.phase in ("forward", "backward")
                  and i != (first_forward if strategy.shard in ("fsdp", "fsdp-noreshard", "hsdp") else last_backward))
        if hidden:
            overlapped += seconds
        else:
            exposed += seconds
    if param_offload:  # each shard in before its all-gather, each gradient shard out after its reduce-scatter
        shards = sum(c.bytes / c.group_size for c in point.collectives
                     if c.group != "tp" and c.op in ("all_gather", "reduce_scatter"))
        seconds = offload_seconds(int(shards), device)
        by_group["host"] = seconds
        sent["host"] = int(shards)
        link_of["host"] = "host link"
        overlapped += seconds
    transfer_s = offload_seconds(getattr(point, "offloaded_bytes", 0), device)
    offload_exposed = max(0.0, transfer_s - compute_s / 3) + max(0.0, transfer_s - 2 * compute_s / 3)
    bubble_s = 0.0
    if getattr(strategy, "pp", 1) > 1:  # the traced rank's compute covers its m micro-batches
        from batchfit.distributed.pp_schedules import bubble_fraction, parse_schedule

        fraction = bubble_fraction(parse_schedule(strategy.pp_schedule, strategy.microbatches), strategy.pp)
        bubble_s = compute_s * fraction / (1 - fraction)
    micro = compute_s + max(0.0, overlapped - compute_s) + exposed + offload_exposed + bubble_s
    return StepTime(compute_s=compute_s, communication_s=by_group, overlapped_s=overlapped, exposed_s=exposed,
                    micro_step_s=micro, accumulation_steps=accumulation_steps,
                    step_time_s=micro * accumulation_steps, flops=point.flops, peak_tflops=peak_tflops,
                    bytes_sent=sent, links=link_of, offload_transfer_s=transfer_s,
                    offload_exposed_s=offload_exposed, pipeline_bubble_s=bubble_s)

