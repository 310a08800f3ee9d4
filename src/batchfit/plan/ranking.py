"""The plan's ranking: every combination of a GPU count ordered by predicted tokens/s, each with
its memory (seed 004's comparison, for every strategy at once). Pure Python, no torch.

Order, per GPU count: the combinations that fit, by tokens/s (samples/s for a model without
tokens; with no time, by global batch), ties to the smaller TP degree, then the lower memory (so
rank 1 is the plan's recommendation); a micro-batch that fits only above the target utilisation
is ranked the same way and marked 'above target'; then those where not even the smallest local
batch fits, then those auto did not trace because they cannot be first (``not traced``: at most their
bound, highest first), then those not traced for another reason (``skipped``: the reason). Ranks count
the fitting ones only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from batchfit.distributed.strategy_name import field_degrees


@dataclass(frozen=True, kw_only=True)
class RankedRow:
    """One combination of one GPU count, as the ranking shows it."""

    rank: int | None
    """1 = the most tokens/s on its GPU count; None for what does not fit or was skipped."""
    gpus: int
    nodes: int
    strategy: str
    pp: int
    dp: int
    tp: int
    cp: int
    ep: int
    shard: str
    status: str
    """'fits', 'above target' (the micro-batch fits the GPU but not under --target-util),
    'does not fit' (not even the smallest local batch), 'not traced' (auto: its bound cannot beat the
    best traced row) or 'skipped' (not traced: a rule cannot apply, or it cannot fit)."""
    why: str | None
    """For 'does not fit' and 'skipped': the reason; for 'above target', by how much."""
    max_local_batch: int
    max_global_batch: int
    micro_batch: int
    accumulation_steps: int
    global_batch: int
    allocated_bytes: int | None
    """Rank 0's peak allocated bytes at the micro-batch (traced; the largest pipeline rank under pp)."""
    reserved_bytes: int | None
    """Rank 0's peak reserved bytes at the micro-batch (allocator model); None under --limit allocated."""
    compute_s: float | None
    """Per optimizer step (x accumulation): FLOPs / (peak x MFU)."""
    exposed_comm_s: float | None
    """Per optimizer step: communication not hidden behind compute (and offload copies not hidden)."""
    bubble_s: float | None
    """Per optimizer step: the pipeline's idle time (0 without pp)."""
    step_time_s: float | None
    tokens_per_s: float | None
    samples_per_s: float | None
    vs_best: float | None
    """Tokens/s (samples/s) over the first rank's on the same GPU count."""
    days: float | None
    mfu: float
    """The MFU the time assumes (the time model's: assumed, set or calibrated)."""
    bound_tokens_per_s: float | None = None
    """'not traced': the most tokens/s it could reach (``plan/speed_bound.py``), not a traced figure."""

    def to_json(self) -> dict:
        return asdict(self)


def _status(p) -> str:
    if p.bound_tokens_per_s is not None:
        return "not traced"
    if p.skipped:
        return "skipped"
    if not p.fits:
        return "does not fit"
    return "above target" if p.above_target else "fits"


def _why(p, target_bytes: int) -> str | None:
    if p.bound_tokens_per_s is not None:  # the status says 'not traced' already
        return p.skipped.removeprefix("not traced: ")
    if p.skipped:
        return p.skipped
    if not p.fits:
        return p.fix[0] if p.fix else "local batch 1 does not fit"
    if p.above_target:
        at = p.peak_reserved_bytes_at_micro or p.peak_bytes_at_micro or 0
        return (f"micro-batch {p.micro_batch} needs {at / 2**30:.2f} GiB, above the target "
                f"{target_bytes / 2**30:.2f} GiB (it fits the GPU)")
    return None


def _split(p) -> tuple[float | None, float | None, float | None]:
    """compute, exposed communication and bubble of one optimizer step."""
    t = p.time
    if t is None:
        return None, None, None
    k = t.accumulation_steps
    comm = max(0.0, t.micro_step_s - t.compute_s - t.pipeline_bubble_s)
    return t.compute_s * k, comm * k, t.pipeline_bubble_s * k


def _speed(p) -> float:
    return p.tokens_per_s or p.samples_per_s or 0.0


def ranked_by(rows) -> str:
    """What the order rests on, in words: the predicted speed, or, when no row has a step time (a
    capacity without a GPU's FLOP/s: --gpu-memory), the keys that order the rows instead."""
    if any(row.tokens_per_s for row in rows):
        return "tokens/s"
    if any(row.samples_per_s for row in rows):
        return "samples/s"
    return ("the largest global batch, then fewer tensor-parallel ranks, then the least memory (no step time: "
            "a memory size alone gives no FLOP/s; name a GPU with --gpu to rank by speed)")


def ranking(plans, worlds, *, mfu: float, target_bytes: int) -> list[RankedRow]:
    """Every plan of every world, in rank order (the module docstring)."""
    order = {"fits": 0, "above target": 0, "does not fit": 1, "not traced": 2, "skipped": 3}
    rows: list[RankedRow] = []
    for world in worlds:
        mine = [p for p in plans if p.gpus == world.gpus]
        # a row not traced sorts by its bound, among its kind
        mine.sort(key=lambda p: (order[_status(p)], -(_speed(p) or p.bound_tokens_per_s or 0.0),
                                 -(p.global_batch or p.max_global_batch), p.tp,
                                 p.peak_reserved_bytes_at_micro or p.peak_bytes_at_micro or 0))
        best = next((_speed(p) for p in mine if p.fits and not p.skipped), 0.0)
        for i, p in enumerate(mine):
            fitting = p.fits and not p.skipped
            compute, comm, bubble = _split(p)
            rows.append(RankedRow(
                rank=i + 1 if fitting else None, gpus=p.gpus, nodes=p.nodes, strategy=p.strategy,
                dp=p.dp, **field_degrees(p),
                shard=p.shard, status=_status(p), why=_why(p, target_bytes),
                max_local_batch=p.max_local_batch, max_global_batch=p.max_global_batch if not p.skipped else 0,
                micro_batch=p.micro_batch, accumulation_steps=p.accumulation_steps, global_batch=p.global_batch,
                allocated_bytes=p.peak_bytes_at_micro, reserved_bytes=p.peak_reserved_bytes_at_micro,
                compute_s=compute, exposed_comm_s=comm, bubble_s=bubble, step_time_s=p.step_time_s,
                tokens_per_s=p.tokens_per_s, samples_per_s=p.samples_per_s,
                vs_best=_speed(p) / best if fitting and best and _speed(p) else None, days=p.days, mfu=mfu,
                bound_tokens_per_s=p.bound_tokens_per_s))
    return rows
