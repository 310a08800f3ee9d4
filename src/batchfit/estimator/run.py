"""``batchfit estimate --data --batching``: the largest batch whose WORST batch in the data fits.

A run dies at its worst step, not its first. The data's sample lengths (``runs/data.py``)
and the batching (``estimator/batching.py``) give every step's shape in the data's order;
the peak is monotone in rows and in tokens per row, so only the shapes no other step covers
are traced (``batching.deciding_steps``): for pad-longest, the batch with the longest padded
length (and the short last batch when it is longer). One model serves every length, as in a
real run: it is built once at the longest length the run needs, and each traced length only
changes the batch (:class:`Lengths`).

1. Trace the estimate at the deciding length (the longest padded batch, MAXLEN, the worst
   token row): its answer is the largest batch whose every step fits.
2. For each traced batch size, its run: the peak step, its allocated and reserved peak, the
   verdict, and where it does not fit, the first step in data order that does not
   (``batching.first_failing``: a bisection over the lengths that occur).
3. ``tokens:N``: whether the worst row fits, and the largest budget whose worst row fits.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from batchfit.devices import Device
from batchfit.errors import ModelSpecError, OptionError
from batchfit.estimator.batching import (
    MAX_TOKENS,
    Batching,
    Shape,
    check_lengths,
    deciding_steps,
    first_failing,
    histogram,
    largest_budget,
    longest_row,
    peak_step,
    step_samples,
    step_shapes,
)
from batchfit.estimator.request import EstimateRequest, RunRequest
from batchfit.trace.approximation import Approximation
from batchfit.trace.point import MemoryPoint, TracedCurve, host_fits
from batchfit.workload import StepOptions, Workload

LoadAt = Callable[[int | None], Workload]
"""(sequence length, None for the model's own) -> the workload, as ``specs.load_workload`` makes it."""


class Lengths:
    """One model, batches of any length: the model of the workload loaded at ``model_len``, the
    batch of the workload loaded at the length asked for (a real run pads each batch, the model
    stays). :meth:`varying` makes batches of whatever :attr:`length` is now."""

    def __init__(self, load: LoadAt, model_len: int) -> None:
        self.load, self.model_len, self.length = load, model_len, model_len
        self.base = load(model_len)
        self._loaded: dict[int, Workload] = {model_len: self.base}

    def _batch_of(self, length: int) -> Workload:
        if length not in self._loaded:
            self._loaded[length] = self.load(length)
        return self._loaded[length]

    def at(self, length: int) -> Workload:
        """The workload whose batches are ``length`` tokens (a longer one than the model was built
        for: the workload loaded at that length)."""
        if length > self.model_len:
            return self._batch_of(length)
        batch = self._batch_of(length)
        return dataclasses.replace(self.base, make_batch=batch.make_batch, tokens_per_sample=length,
                                   description=batch.description)

    def select(self, length: int) -> None:
        """Make :meth:`varying`'s batches ``length`` tokens from now on (loaded now, outside any trace)."""
        self._batch_of(length)
        self.length = length

    def varying(self, lengths: list[int]) -> Workload:
        """The workload whose batches have :attr:`length` tokens at each call (one model, many steps),
        for these ``lengths``: loaded now, not inside a trace (a workload may make tensors as it loads)."""
        for length in lengths:
            self._batch_of(length)
        return dataclasses.replace(self.base,
                                   make_batch=lambda b, device: self._batch_of(self.length).make_batch(b, device))


def fits(point: MemoryPoint, device: Device, limit: str, host_limit_bytes: int | None) -> bool:
    """A traced point under the limit (reserved: its allocator replay must have run)."""
    if point.reserved_oom or not host_fits(point, host_limit_bytes):
        return False
    return max(point.peak_bytes, point.peak_reserved_bytes or 0) <= device.usable_bytes


OPEN_CURVES = 2
"""Lengths whose traced curve stays open (its points are kept when it closes; a new batch size at
a closed length builds the model again)."""


def said_once(say: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    """``say``, each message that starts with ``prefix`` said only once: the model is built again at every row
    length ("tracing N tokens per row" says which), and "building X on fake tensors" once is enough."""
    said: set[str] = set()

    def once(message: str) -> None:
        if message.startswith(prefix):
            if message in said:
                return
            said.add(message)
        say(message)

    return once


class ShapeTracer:
    """Traced points by (rows, length), one :class:`TracedCurve` per length, each shape traced once.

    Whether a shape fits is first answered from shapes already known, by monotonicity: one that
    covers a shape that does not fit does not fit, one that a fitting shape covers fits."""

    def __init__(self, lengths: Lengths, options: StepOptions, device: Device, *, limit: str,
                 host_limit_bytes: int | None, say: Callable[[str], None],
                 known: dict[Shape, MemoryPoint] | None = None) -> None:
        self.lengths, self.options, self.device, self.limit = lengths, options, device, limit
        self.host_limit_bytes, self.say = host_limit_bytes, say
        self.known: dict[Shape, MemoryPoint] = dict(known or {})
        self._fit: dict[Shape, bool] = {shape: self._judge(p) for shape, p in self.known.items()
                                        if self._judged(p)}
        self._curves: dict[int, TracedCurve] = {}
        self.traced: list[Shape] = []
        """Shapes traced here (beyond ``known``), in order."""

    def _judged(self, point: MemoryPoint) -> bool:
        """Whether the point says if it fits: replayed, or over the device already as allocated."""
        return (self.limit != "reserved" or point.peak_reserved_bytes is not None or point.reserved_oom is not None
                or point.peak_bytes > self.device.usable_bytes)

    def _judge(self, point: MemoryPoint) -> bool:
        return fits(point, self.device, self.limit, self.host_limit_bytes)

    def point(self, shape: Shape, *, judged: bool = False) -> MemoryPoint:
        """The traced point of ``shape``; with ``judged``, replayed where reserved memory decides."""
        point = self.known.get(shape)
        if point is not None and (not judged or self._judged(point)):
            return point
        curve = self._curves.pop(shape.length, None)
        if curve is None:
            self.say(f"tracing {shape.length:,} tokens per row")
            curve = TracedCurve(self.lengths.at(shape.length), self.options, self.device, self.say,
                                keep_streams=self.limit == "reserved")
        self._curves[shape.length] = curve  # the most recent last
        while len(self._curves) > OPEN_CURVES:  # each holds a model on fake tensors (and a forked process)
            self._curves.pop(next(iter(self._curves))).close()
        if shape not in self.traced:
            self.traced.append(shape)
        point = curve.point(shape.rows)
        if judged and not self._judged(point):
            point = curve.reserved(shape.rows)
        self.known[shape] = point
        return point

    def fits(self, shape: Shape) -> bool:
        if shape not in self._fit:
            if any(not ok and shape.covers(other) for other, ok in self._fit.items()):
                return False
            if any(ok and other.covers(shape) for other, ok in self._fit.items()):
                return True
            self._fit[shape] = self._judge(self.point(shape, judged=True))
        return self._fit[shape]

    def bounds(self, rows: int) -> tuple[int | None, int | None]:
        """(the longest length known to fit, the shortest known not to) at ``rows``."""
        fit = [s.length for s, ok in self._fit.items() if ok and s.rows == rows]
        fail = [s.length for s, ok in self._fit.items() if not ok and s.rows == rows]
        return max(fit, default=None), min(fail, default=None)

    def close(self) -> None:
        while self._curves:
            self._curves.pop(next(iter(self._curves))).close()


@dataclass
class RunPoint:
    """One batch size over the whole data: ``run`` in each point of the JSON."""

    batch_size: int
    steps: int
    peak_bytes: int
    """Allocated peak of the run (its worst step, traced)."""
    peak_reserved_bytes: int | None
    peak_step: int
    """Counted from 0 in the data's order."""
    peak_shape: Shape
    verdict: str
    """'fits' or 'does not fit'."""
    first_oom_step: int | None = None
    first_oom_shape: Shape | None = None
    peak_samples: range | None = None
    """The samples (indices in the data's order) the peak step batches; None under pack (rows cut samples)."""
    longest_sample: int | None = None
    """The longest of them: the sample that sets the peak step's length."""

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "peak_step": self.peak_step, "verdict": self.verdict, "first_oom_step": self.first_oom_step,
                "steps": self.steps, "peak_rows": self.peak_shape.rows, "peak_length": self.peak_shape.length,
                "first_oom_length": self.first_oom_shape.length if self.first_oom_shape else None,
                "peak_samples": [self.peak_samples.start, self.peak_samples.stop - 1] if self.peak_samples else None,
                "longest_sample": self.longest_sample}


@dataclass
class RunSummary:
    """What the data and its batching make of the estimate: rendered by report/ (no torch)."""

    data: str
    batching: str
    samples: int
    lengths: dict[str, float]
    """min, median (the upper one), mean, p90, p99, max tokens per sample."""
    histogram: list[tuple[int, int, int]]
    traced_length: int
    """The tokens per row the estimate was traced at (the deciding length)."""
    rows: int = 0
    """Rows the data makes at batch 1 (samples, or packed rows): no batch is larger."""
    runs: dict[int, RunPoint] = field(default_factory=dict)
    max_batch_size: int = 0
    """The largest traced batch size whose run fits, every smaller traced one fitting too."""
    traced_shapes: list[tuple[int, int]] = field(default_factory=list)
    token_budget: int | None = None
    largest_budget: int | None = None
    """tokens:N: the largest budget whose worst row fits (None: not even one sample fits)."""
    fits_up_to: int | None = None
    """tokens:N: the longest row traced to fit (and the next step up traced not to)."""
    churn: object | None = None
    """--replay-steps K: the answer's first K steps through the allocator model (``estimator/churn.py``)."""
    churn_worst: object | None = None
    """--replay-order worst: the same K steps in the order (of those tried) that ends worst."""

    def to_json(self) -> dict:
        return {"data": self.data, "batching": self.batching, "samples": self.samples, "lengths": self.lengths,
                "histogram": [list(b) for b in self.histogram], "traced_length": self.traced_length,
                "rows": self.rows, "max_batch_size": self.max_batch_size,
                "traced_shapes": [list(s) for s in self.traced_shapes],
                "token_budget": self.token_budget, "largest_budget": self.largest_budget,
                "fits_up_to": self.fits_up_to, "churn": self.churn.to_json() if self.churn is not None else None,
                "churn_worst_order": self.churn_worst.to_json() if self.churn_worst is not None else None}


def length_stats(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)

    def at(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "mean": round(statistics.fmean(ordered), 1),
            "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def model_length(lengths: list[int], batching: Batching, seq_len: int | None, load: LoadAt) -> int:
    """The longest row the run makes, which the model is built for: the longest sample (already
    cut at --seq-len), the model's length for pad-max, MAXLEN, or the token budget."""
    if batching.kind == "pad-longest":
        return max(lengths)
    if batching.kind == "pad-max":
        return seq_len or load(None).tokens_per_sample or max(lengths)
    return batching.tokens


def padding_mask_approximation(batching: Batching, shape: Shape, workload: Workload) -> list[Approximation]:
    """A padded batch of a transformers model carries an attention mask, which the traced batch
    does not (a model with its own attention code, ``Workload.attention`` None, takes none)."""
    if batching.kind not in ("pad-longest", "pad-max") or workload.attention is None:
        return []
    mask = shape.rows * shape.length ** 2
    return [Approximation(
        what=f"--batching {batching}: the batches are traced without their padding mask (attention_mask)",
        may_differ_by=f"about {mask:,} B at the peak batch ({shape.rows} x {shape.length:,} tokens): transformers "
                      "turns a padding mask into a [batch, 1, T, T] bool mask for eager and SDPA attention, and SDPA "
                      "then cannot use its flash kernel (that cost not measured)",
        source="docs/run.md, Padding masks")]


def routing_schedule_approximation(options: StepOptions, replay_steps: int) -> Approximation:
    """--routing per step: which traces ran which routing."""
    return Approximation(
        what=f"--routing {options.routing_schedule}: the batch sizes searched and each one's run are traced with step "
             f"0's routing ({options.routing_spec}); the allocator replay's {replay_steps} steps each with its own",
        may_differ_by="where a later step's routing costs more than step 0's, the answer can be too large: the "
                      "replay's verdict and the step it names as the run's peak say so",
        source="docs/run.md, MoE routing per step")


def step_peaks(at: Lengths, shapes: list[Shape], options: StepOptions, *, cuda_semantics: bool = True) -> list[int]:
    """Every step's traced peak (the step's tensors: no cuBLAS workspace), in the data's order: one
    model on fake tensors runs one step per distinct shape (steps of equal shape share it), each
    from the state a run has there (parameters, optimizer state, no gradients). ``cuda_semantics=False``
    traces what a CPU step does (the truth tests' profiler compares it)."""
    from batchfit.trace.session import TraceSession  # the tracer (torch): only here

    peaks: dict[Shape, int] = {}
    with TraceSession(at.varying([s.length for s in shapes]), options, cuda_semantics=cuda_semantics) as session:
        for shape in dict.fromkeys(shapes):
            at.length = shape.length
            peaks[shape] = session.trace(shape.rows).snapshot.peak_bytes
    return [peaks[s] for s in shapes]


def run_point(batch_size: int, shapes: list[Shape], tracer: ShapeTracer) -> RunPoint:
    """The run at one batch size: its deciding steps traced, and where one does not fit, the first
    step that does not, found by bisection (a few traces more)."""
    deciding = deciding_steps(shapes)
    points = {i: tracer.point(shapes[i]) for i in deciding}
    worst = peak_step(shapes, lambda shape: tracer.point(shape).peak_bytes)
    reserved = [p.peak_reserved_bytes for p in points.values() if p.peak_reserved_bytes is not None]
    run = RunPoint(batch_size=batch_size, steps=len(shapes), peak_bytes=points[worst].peak_bytes,
                   peak_reserved_bytes=max(reserved) if reserved else None, peak_step=worst,
                   peak_shape=shapes[worst], verdict="fits")
    if not all(tracer.fits(shapes[i]) for i in deciding):
        run.verdict = "does not fit"
        run.first_oom_step = first_failing(shapes, tracer.fits)
        run.first_oom_shape = shapes[run.first_oom_step] if run.first_oom_step is not None else None
    return run


def estimate_run(load: LoadAt, lengths: list[int], run_request: RunRequest, request: EstimateRequest | None = None,
                 *, device: Device, options: StepOptions | None = None,
                 progress: Callable[[str], None] | None = None):
    """The estimate at the run's deciding length, each traced batch size's run, and the answer in
    the batching's terms; with ``run_request.replay_steps`` the answer's first K steps replayed through the
    allocator model (``estimator/churn.py``). ``request`` (default ``EstimateRequest()``) goes to
    :func:`estimator.engine.estimate`, its eval loop traced over the data's batches here."""
    from batchfit.estimator.engine import estimate  # the one-shape engine, run at the deciding length

    say = said_once(progress or (lambda message: None), "building ")  # the model is built again at each length
    options = options or StepOptions()
    request = request or EstimateRequest()
    batching, seq_len, limit = run_request.batching, run_request.seq_len, request.limit
    host_memory_bytes, eval_batch_size = request.host_memory_bytes, request.eval_batch_size
    if seq_len is not None:  # the tokenizer's max_length: every sample cut to it before batching
        lengths = [min(n, seq_len) for n in lengths]
    check_lengths(lengths, batching)
    if batching.kind == "tokens" and eval_batch_size:
        raise OptionError(f"`batching` {batching} makes one row per step, so there is no eval batch size: drop "
                          "`eval_batch_size` (or batch `data` by pad-longest / pack:MAXLEN)")
    if batching.kind == "tokens" and (request.global_batch is not None or request.batch_sizes):
        raise OptionError(f"`batching` {batching} makes one row per GPU per step, so drop `global_batch` and "
                          "`batch_sizes` (the answer is the token budget)")
    model_len = model_length(lengths, batching, seq_len, load)

    def shapes_at(b: int) -> list[Shape]:
        return step_shapes(lengths, batching, b, model_len)

    worst = max(shapes_at(1), key=lambda s: s.length).length
    try:
        at = Lengths(load, model_len)
    except ModelSpecError as error:  # its words are --seq-len's, which the user may not have given
        raise ModelSpecError(f"`data` makes rows of {model_len:,} tokens with `batching` {batching}: {error} "
                             "(give `seq_len` to truncate the samples, or a smaller budget)") from None
    # A batch larger than the data is the whole data: the search stops at the rows the data makes.
    rows = sum(s.rows for s in shapes_at(1))
    if batching.kind == "tokens":
        sizes = {"batch_sizes": [1], "max_batch": 1}
    elif request.batch_sizes and max(request.batch_sizes) > rows:
        raise OptionError(f"`batch_sizes` {max(request.batch_sizes)}: the data makes {rows:,} rows with `batching` "
                          f"{batching}, so no batch can be larger")
    else:
        sizes = {"max_batch": min(request.max_batch, rows)}
    # the eval loop is traced below, over the data's batches, not at the one shape
    result = estimate(at.at(worst), dataclasses.replace(request, eval_batch_size=None, **sizes), device=device,
                      options=options, progress=say)
    summary = RunSummary(data=run_request.data, batching=str(batching), samples=len(lengths),
                         lengths=length_stats(lengths), histogram=histogram(lengths), traced_length=worst, rows=rows,
                         token_budget=batching.tokens if batching.kind == "tokens" else None)
    tracer = ShapeTracer(at, result.options, device, limit=limit, host_limit_bytes=host_memory_bytes, say=say,
                         known={Shape(p.batch_size, worst): p for p in result.points})  # the estimate's own
    try:
        for point in result.points:
            run = summary.runs[point.batch_size] = run_point(point.batch_size, shapes_at(point.batch_size), tracer)
            run.peak_samples = step_samples(lengths, batching, point.batch_size, run.peak_step)
            if run.peak_samples:
                run.longest_sample = max(run.peak_samples, key=lambda i: (lengths[i], -i))
        for b in sorted(summary.runs):
            if summary.runs[b].verdict != "fits":
                break
            summary.max_batch_size = b
        if batching.kind == "tokens":
            summary.fits_up_to = _longest_row_that_fits(tracer, max(lengths), say)
            summary.largest_budget = (largest_budget(lengths, summary.fits_up_to)
                                      if summary.fits_up_to and summary.fits_up_to >= max(lengths) else None)
    finally:
        tracer.close()
    if eval_batch_size and summary.max_batch_size:  # the eval batches: the same data, batched the same way
        from batchfit.estimator.eval_phase import eval_approximations, eval_phase

        best = summary.max_batch_size
        result.eval_phase = eval_phase(at.varying([]), at.select, shapes_at, eval_batch_size, best,
                                       summary.runs[best].peak_shape, result.options, device,
                                       held_steps=request.eval_held_steps, limit=limit, say=say)
        result.approximations = [*result.approximations,
                                 *eval_approximations(result.eval_phase, result.options, True)]
    replay_steps = run_request.replay_steps
    if replay_steps and summary.max_batch_size:
        from batchfit.estimator.churn import churn, worst_order

        say(f"replaying {replay_steps} steps at batch {summary.max_batch_size} through the allocator model")
        if run_request.replay_order == "worst":
            summary.churn_worst = worst_order(at, shapes_at(summary.max_batch_size)[:replay_steps],
                                              summary.max_batch_size, result.options, device)
        summary.churn = churn(at, shapes_at(summary.max_batch_size)[:replay_steps], summary.max_batch_size,
                              result.options, device)
    if options.routing_schedule.varies:
        result.approximations = [*result.approximations, routing_schedule_approximation(options, replay_steps)]
    summary.traced_shapes = [(s.rows, s.length) for s in tracer.traced]
    peak = summary.runs[summary.max_batch_size or min(summary.runs)].peak_shape
    result.approximations = [*result.approximations, *padding_mask_approximation(batching, peak, at.base)]
    result.run = summary
    return result


def _longest_row_that_fits(tracer: ShapeTracer, longest_sample: int, say: Callable[[str], None]) -> int | None:
    """The longest single row traced to fit (its next step up traced not to), from the rows
    already traced: doubled while it fits, then bisected to within 1/64 of it. Where a row no
    longer than the longest sample does not fit, no budget can: the longest row known to fit."""
    fit, fail = tracer.bounds(1)
    if fail is not None and fail <= longest_sample:
        return fit
    while fail is None:
        longer = min(fit * 2, MAX_TOKENS)
        try:
            ok = tracer.fits(Shape(1, longer))
        except ModelSpecError:  # longer than the model allows (max_position_embeddings)
            return fit
        if ok and longer == MAX_TOKENS:
            return longer
        fit, fail = (longer, None) if ok else (fit, longer)
    low = fit or 0
    while fail - low > max(1, low // 64) and fail > longest_sample:
        middle = (low + fail) // 2
        if tracer.fits(Shape(1, middle)):
            low = middle
        else:
            fail = middle
    say(f"one row of {low:,} tokens fits, {fail:,} does not")
    return low or None


def data_lengths(data: str, *, model: str, length_column: str | None = None, tokenizer: str | None = None) -> list[int]:
    """Tokens per sample of ``--data``, in its order, before any trace: with ``--tokenizer`` (loaded
    now, so a name that cannot load is one line at once), else the model's own where its folder
    has one (``hf:path/to/model``), else only rows that need no tokenizer."""
    from pathlib import Path

    from batchfit.runs.data import cached_tokenizer, sample_lengths, tokenizer_named

    if tokenizer is not None:
        loaded = tokenizer_named(tokenizer)
        return sample_lengths(data, length_column=length_column, tokenizer=lambda: loaded)
    folder = Path(model.removeprefix("hf:")).expanduser() if model.startswith("hf:") else None
    own = folder is not None and folder.is_dir() and any((folder / f).is_file() for f in
                                                         ("tokenizer.json", "tokenizer_config.json"))
    return sample_lengths(data, length_column=length_column,
                          tokenizer=(lambda: cached_tokenizer(str(folder))) if own else None)


def data_row_length(data: str, batching: Batching, *, model: str, seq_len: int | None = None,
                    length_column: str | None = None, tokenizer: str | None = None) -> tuple[int | None, dict]:
    """``plan --data``: (the tokens per row every rank is traced at, the JSON's ``data`` section). A rank of
    a data-parallel run steps on the batches its sampler deals it, none with a row longer than the data's
    longest (``batching.longest_row``): tracing each rank there is never low, and exact for the step that
    holds the longest sample in a full batch. One line before any trace for what plan cannot answer."""
    if batching.kind == "tokens":
        raise OptionError(f"plan `batching` {batching}: a token budget makes one row per GPU per step, which plan's "
                          "micro-batch search does not take; use estimate `data` ... `batching` "
                          f"{batching}, or plan with `batching` pack:{batching.tokens}")
    lengths = data_lengths(data, model=model, length_column=length_column, tokenizer=tokenizer)
    cut = [min(n, seq_len) for n in lengths] if seq_len is not None else lengths
    check_lengths(cut, batching)
    row = longest_row(cut, batching, seq_len)
    return row, {"data": data, "batching": str(batching), "samples": len(cut), "lengths": length_stats(cut),
                 "traced_length": row}
