"""How a run batches its data (``estimate --data --batching``): the shape of every step, in the
data's order, and which steps decide the run's peak. No torch: pure functions of the lengths.

- ``pad-longest``: ``batch_size`` samples in order, each batch padded to its longest sample
  (a collator's ``padding="longest"``; the last batch may be short, as with ``drop_last=False``).
- ``pad-max``: every batch padded to the model's maximum length (``padding="max_length"``).
- ``pack:MAXLEN``: the samples concatenated in order and cut into rows of MAXLEN tokens (TRL's
  ``packing=True`` with ``max_length``, the wrapped strategy); a step takes ``batch_size`` rows.
- ``tokens:N``: padding-free token budgets: samples in order fill one row of up to N tokens
  per GPU (a sample that would pass N starts the next row: ``max_tokens_per_gpu`` /
  ``ppo_max_token_len_per_gpu``); a step is that one row.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.errors import OptionError

BATCHINGS = ("pad-longest", "pad-max", "pack:MAXLEN", "tokens:N")
MAX_TOKENS = 1 << 24
"""The most tokens a row may have (``specs.load_workload``'s bound on --seq-len)."""


@dataclass(frozen=True)
class Batching:
    """``--batching``, parsed once."""

    kind: str
    """'pad-longest', 'pad-max', 'pack' or 'tokens'."""
    tokens: int | None = None
    """pack's MAXLEN or tokens' N."""

    def __str__(self) -> str:
        return self.kind if self.tokens is None else f"{self.kind}:{self.tokens}"

    @property
    def rows_fixed(self) -> bool:
        """Whether a step's row count is the batch size (every kind but tokens:N: one row)."""
        return self.kind != "tokens"


def parse_batching(text: str) -> Batching:
    """``pad-longest``, ``pad-max``, ``pack:4096`` or ``tokens:16384``; a one-line error otherwise."""
    kind, _, number = text.strip().partition(":")
    if kind in ("pad-longest", "pad-max") and not number:
        return Batching(kind)
    if kind in ("pack", "tokens"):
        try:
            value = int(number.replace("_", ""))
        except ValueError:
            value = 0
        if value > MAX_TOKENS:
            raise OptionError(f"`batching` {text} is more than {MAX_TOKENS:,} tokens (2^24) per row, the most "
                              "a sequence can have here")
        if value >= 1:
            return Batching(kind, value)
        raise OptionError(f"`batching` {text} needs a token count after {kind}, e.g. `batching` {kind}:4096")
    raise OptionError(f"`batching` {text} is none of {', '.join(BATCHINGS)}; e.g. `batching` pad-longest")


@dataclass(frozen=True)
class Shape:
    """One step's batch: ``rows`` sequences of ``length`` tokens (padded or packed to it)."""

    rows: int
    length: int

    def covers(self, other: Shape) -> bool:
        """At least as many rows and tokens per row: its peak is no lower (monotone in both)."""
        return self.rows >= other.rows and self.length >= other.length


def longest_row(lengths: list[int], batching: Batching, seq_len: int | None) -> int | None:
    """The longest row any step of the data makes (each sample cut at ``seq_len``): the longest sample
    padded, pack's MAXLEN, tokens' N, or for pad-max ``seq_len`` (None: the model's own). A rank of a
    data-parallel run holds at most the batch size of such rows, whichever samples its sampler deals it."""
    if batching.kind == "pad-longest":
        return max(min(n, seq_len) if seq_len else n for n in lengths)
    return seq_len if batching.kind == "pad-max" else batching.tokens


def check_lengths(lengths: list[int], batching: Batching) -> None:
    """Refuse, before any trace, a token budget that a single sample passes."""
    longest = max(lengths)
    if batching.kind == "tokens" and batching.tokens < longest:
        raise OptionError(f"`batching` {batching} is less than the longest sample ({longest:,} tokens), which no "
                          f"row can split: give at least `batching` tokens:{longest}")


def step_shapes(lengths: list[int], batching: Batching, batch_size: int, max_len: int) -> list[Shape]:
    """The shape of every step over the data, in its order. ``max_len`` is pad-max's length; no
    row is longer (the samples are cut to it)."""
    cut = [min(n, max_len) for n in lengths]
    if batching.kind == "pad-longest":
        return [Shape(len(cut[i:i + batch_size]), max(cut[i:i + batch_size])) for i in range(0, len(cut), batch_size)]
    if batching.kind == "pad-max":
        return [Shape(len(cut[i:i + batch_size]), max_len) for i in range(0, len(cut), batch_size)]
    if batching.kind == "pack":
        rows = -(-sum(lengths) // batching.tokens)  # every row MAXLEN: the last one padded
        return [Shape(min(batch_size, rows - i), batching.tokens) for i in range(0, rows, batch_size)]
    return [Shape(1, n) for n in token_rows(cut, batching.tokens)]


def step_samples(lengths: list[int], batching: Batching, batch_size: int, step: int) -> range | None:
    """The samples (indices in the data's order) that ``step`` batches; None for pack (its rows cut samples)."""
    if batching.kind in ("pad-longest", "pad-max"):
        return range(step * batch_size, min(len(lengths), (step + 1) * batch_size))
    if batching.kind == "pack":
        return None
    start, row, rows = 0, 0, 0
    for i, n in enumerate(lengths):
        if row and row + n > batching.tokens:
            if rows == step:
                return range(start, i)
            start, row, rows = i, 0, rows + 1
        row += n
    return range(start, len(lengths)) if rows == step else None


def token_rows(lengths: list[int], budget: int, stop_above: int | None = None) -> list[int]:
    """Row lengths of greedy token-budget batching in order; stops early once a row passes ``stop_above``."""
    rows, row = [], 0
    for n in lengths:
        if row and row + n > budget:
            rows.append(row)
            if stop_above is not None and row > stop_above:
                return rows
            row = 0
        row += n
    return rows + [row] if row else rows


def largest_budget(lengths: list[int], fits_up_to: int) -> int:
    """The largest token budget N whose every row is at most ``fits_up_to`` tokens (so fits).

    Any budget up to ``fits_up_to`` does; above it, a row other than the last ends only when the
    next sample would pass N, so once N - longest >= fits_up_to some row passes it: only the
    budgets between are tried, the largest first (a budget that fails mostly fails in its first
    rows; the first that passes is the answer, after one whole pass)."""
    for budget in range(fits_up_to + max(lengths), fits_up_to, -1):
        if max(token_rows(lengths, budget, stop_above=fits_up_to)) <= fits_up_to:
            return budget
    return fits_up_to


def deciding_steps(shapes: list[Shape]) -> list[int]:
    """The steps whose shape no other step covers (the first of equal ones), in data order.

    Why only these: for a fixed number of rows the peak only grows with the tokens per row
    (every activation, the logits and eager attention's scores grow with it; nothing shrinks),
    and for a fixed length it only grows with the rows. So a step whose shape another step
    covers can never set the run's peak, nor be the only one that does not fit. Under
    pad-longest these are the full batch with the longest padded length and, when longer, the
    short last batch: at most two traces per batch size, however many steps the data makes."""
    deciding: list[int] = []
    for i, shape in enumerate(shapes):
        if any(shapes[j].covers(shape) for j in deciding):
            continue
        deciding = [j for j in deciding if not shape.covers(shapes[j])] + [i]
    return sorted(deciding)


def peak_step(shapes: list[Shape], peak_of) -> int:
    """The step that sets the run's peak: the deciding step of the largest ``peak_of(shape)``
    (the first of equal ones); no other step is asked about."""
    return max(deciding_steps(shapes), key=lambda i: (peak_of(shapes[i]), -i))


def histogram(lengths: list[int], bins: int = 20) -> list[tuple[int, int, int]]:
    """(from, to inclusive, samples) over equal-width bins of the lengths."""
    low, high = min(lengths), max(lengths)
    width = max(1, -(-(high - low + 1) // bins))
    counts: dict[int, int] = {}
    for n in lengths:
        counts[(n - low) // width] = counts.get((n - low) // width, 0) + 1
    return [(low + k * width, low + (k + 1) * width - 1, counts.get(k, 0)) for k in range((high - low) // width + 1)]


def first_failing(shapes: list[Shape], fits) -> int | None:
    """The first step, in data order, whose shape does not fit (``fits(shape) -> bool``, asked
    for few shapes): for each row count, the longest length that fits is found by bisection over
    the lengths that occur (monotone in length), so a run of thousands of steps costs about
    log2(distinct lengths) questions per row count. The first step is asked first: where it
    does not fit (a token budget whose rows are all near N), that is the answer in one question."""
    if shapes and not fits(shapes[0]):
        return 0
    first: int | None = None
    for rows in sorted({s.rows for s in shapes}):
        lengths = sorted({s.length for s in shapes if s.rows == rows})
        fit, fail = -1, len(lengths)  # lengths[:fit + 1] fit, lengths[fail:] do not
        while fail - fit > 1:
            middle = (fit + fail) // 2
            if fits(Shape(rows, lengths[middle])):
                fit = middle
            else:
                fail = middle
        if fail < len(lengths):
            step = next(i for i, s in enumerate(shapes) if s.rows == rows and s.length >= lengths[fail])
            first = step if first is None else min(first, step)
    return first


def check_run_flags(data: str | None, batching: str | None, length_column: str | None,
                    tokenizer: str | None, replay_steps: int = 0, replay_order: str = "data") -> Batching | None:
    """``--batching`` (pad-longest when only --data is given), or None without --data; the flags
    that need --data refused without it."""
    if data is None:
        given = [flag for flag, value in (("`batching`", batching), ("`length_column`", length_column),
                                          ("`tokenizer`", tokenizer), ("`replay_steps`", replay_steps or None))
                 if value is not None]
        if given:
            raise OptionError(f"{given[0]} describes the data of a run: give `data` PATH too (a .txt, .jsonl or "
                              f".parquet file or a folder), e.g. `data` train.jsonl {given[0]} ...")
        return None
    if replay_steps < 0:
        raise OptionError(f"`replay_steps` {replay_steps} is no number of steps: e.g. `replay_steps` 50 (0: none)")
    if replay_order not in ("data", "worst"):
        raise OptionError(f"`replay_order` {replay_order}: give data (the data's order) or worst (also the orders "
                          "that fragment most, of those tried)")
    if replay_order == "worst" and not replay_steps:
        raise OptionError("`replay_order` worst reorders the replayed steps: give `replay_steps` K too")
    return parse_batching(batching or "pad-longest")
