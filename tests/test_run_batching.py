"""``estimate --data --batching``'s pure parts (estimator/batching.py), numbers checked by hand, and
its bad input: one line each, exit 2, before any trace."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.errors import OptionError
from batchfit.estimator.batching import (
    Batching,
    Shape,
    check_lengths,
    check_run_flags,
    deciding_steps,
    first_failing,
    histogram,
    largest_budget,
    parse_batching,
    peak_step,
    step_samples,
    step_shapes,
    token_rows,
)
from batchfit.runs.data import sample_lengths

LENGTHS = [5, 9, 3, 20, 7, 7, 2]


def test_batching_is_parsed_once_and_refused_in_one_line():
    assert parse_batching("pad-longest") == Batching("pad-longest")
    assert parse_batching("pack:4_096") == Batching("pack", 4096)
    assert str(parse_batching("tokens:16384")) == "tokens:16384"
    for bad in ("pack", "tokens:0", "tokens:many", "pad", "pad-max:8", "tokens:99999999999999999999"):
        with pytest.raises(OptionError, match="`batching`"):
            parse_batching(bad)


def test_each_batching_makes_the_steps_a_collator_makes():
    assert step_shapes(LENGTHS, Batching("pad-longest"), 3, 64) == [Shape(3, 9), Shape(3, 20), Shape(1, 2)]
    assert step_shapes(LENGTHS, Batching("pad-longest"), 3, 8) == [Shape(3, 8), Shape(3, 8), Shape(1, 2)]  # truncated
    assert step_shapes(LENGTHS, Batching("pad-max"), 3, 32) == [Shape(3, 32), Shape(3, 32), Shape(1, 32)]
    # 53 tokens packed into rows of 16: 4 rows (the last padded), 3 a step
    assert step_shapes(LENGTHS, Batching("pack", 16), 3, 64) == [Shape(3, 16), Shape(1, 16)]
    # budget 20: 5+9+3=17 | 20 | 7+7+2=16
    assert token_rows(LENGTHS, 20) == [17, 20, 16]
    assert step_shapes(LENGTHS, Batching("tokens", 20), 1, 64) == [Shape(1, 17), Shape(1, 20), Shape(1, 16)]
    # which samples each step holds: by the batch, and by the greedy rows
    assert step_samples(LENGTHS, Batching("pad-longest"), 3, 2) == range(6, 7)
    assert [step_samples(LENGTHS, Batching("tokens", 20), 1, i) for i in range(3)] == [range(0, 3), range(3, 4),
                                                                                        range(4, 7)]
    assert step_samples(LENGTHS, Batching("pack", 16), 3, 0) is None


def test_only_the_steps_no_other_covers_decide_and_the_first_of_equals():
    shapes = [Shape(4, 10), Shape(4, 30), Shape(4, 30), Shape(4, 12), Shape(2, 50)]
    assert deciding_steps(shapes) == [1, 4]  # (4, 30) covers every full batch; the short last one is longer
    assert deciding_steps([Shape(4, 10), Shape(4, 10)]) == [0]
    # the peak of each deciding step decides which sets the run's peak
    assert peak_step(shapes, lambda s: s.rows * s.length) == 1
    assert peak_step(shapes, lambda s: s.rows * s.length ** 2) == 4


def test_the_first_failing_step_is_found_by_bisection_over_the_lengths_that_occur():
    shapes = [Shape(4, n) for n in (10, 40, 20, 35, 50, 15)] + [Shape(1, 60)]
    asked = []

    def fits(shape: Shape) -> bool:  # fits up to 4 x 30 tokens and one row of 60
        asked.append(shape)
        return shape.rows * shape.length <= 120 or shape.rows == 1

    assert first_failing(shapes, fits) == 1  # 4 x 40 is the first that does not
    assert len(asked) <= 5  # log2 of the 6 lengths of 4 rows, and the one of 1 row
    assert first_failing(shapes, lambda s: True) is None
    asked.clear()
    assert first_failing(shapes[1:], fits) == 0 and asked == [Shape(4, 40)]  # the first step: one question


def test_a_token_budget_below_the_longest_sample_and_the_largest_budget():
    with pytest.raises(OptionError, match="longest sample \\(20 tokens\\).*tokens:20"):
        check_lengths(LENGTHS, Batching("tokens", 19))
    check_lengths(LENGTHS, Batching("tokens", 20))
    # rows of up to 24 tokens fit: budgets 24..26 make 17 | 20 | 16; 27 puts 20+7 in a row, and every
    # budget above does too (or more), up to 24 + 20 where the scan ends
    assert token_rows(LENGTHS, 26) == [17, 20, 16]
    assert token_rows(LENGTHS, 27) == [17, 27, 9]
    assert largest_budget(LENGTHS, 24) == 26
    assert largest_budget([1000] * 100_000, 16_500) == 16_999  # rows of 16 samples up to 16,999: one pass


def test_building_the_model_is_said_once_over_the_lengths():
    from batchfit.estimator.run import said_once

    lines = []
    say = said_once(lines.append, "building ")
    for length in (512, 1024, 512):
        say(f"tracing {length:,} tokens per row")
        say("building gpt on fake tensors")
    assert lines == ["tracing 512 tokens per row", "building gpt on fake tensors", "tracing 1,024 tokens per row",
                     "tracing 512 tokens per row"]


def test_histogram_bins_cover_every_sample():
    bins = histogram(LENGTHS, bins=4)  # 2..20: width 5
    assert bins == [(2, 6, 3), (7, 11, 3), (12, 16, 0), (17, 21, 1)]


def test_lengths_come_from_a_length_column_input_ids_or_text(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in ({"n": 3, "input_ids": [1, 2]}, {"n": 5, "text": "abc"})))
    assert sample_lengths(str(rows), length_column="n") == [3, 5]
    from batchfit.runs.data import bytes_tokenizer

    assert sample_lengths(str(rows), tokenizer=bytes_tokenizer) == [2, 3]
    text = tmp_path / "lines.txt"
    text.write_text("hello\n\nworld!\n")
    assert sample_lengths(str(text), tokenizer=bytes_tokenizer) == [5, 6]


@pytest.mark.parametrize("args, message", [
    (["--data", "{empty}"], "holds no samples"),
    (["--data", "{rows}", "--length-column", "tokens"], "no column 'tokens' (columns: n, text)"),
    (["--data", "{rows}", "--tokenizer", "{missing}"], "--tokenizer"),
    (["--data", "{rows}", "--length-column", "n", "--batching", "tokens:4"], "longest sample (9 tokens)"),
    (["--batching", "pad-longest"], "--batching describes the data of a run: give --data"),
    (["--data", "{rows}"], "holds text and no tokenizer"),
])
def test_bad_input_is_one_line_before_any_trace(tmp_path, args, message):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "rows.jsonl").write_text('{"n": 3, "text": "abc"}\n{"n": 9, "text": "abcdefghi"}\n')
    paths = {"empty": tmp_path / "empty.jsonl", "rows": tmp_path / "rows.jsonl", "missing": tmp_path / "no-tokenizer"}
    result = CliRunner().invoke(app, ["estimate", "gpt-tinystories-22m", "--gpu", "t4",
                                      *[a.format(**paths) for a in args]])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "tracing" not in result.output and len(result.output.strip().splitlines()) <= 3


def test_text_is_tokenized_with_the_model_folders_own_tokenizer(tmp_path):
    """hf:FOLDER with a tokenizer.json: its tokenizer counts the tokens, as the run would make them."""
    pytest.importorskip("transformers")
    from batchfit.estimator.run import data_lengths
    from batchfit.runs.data import train_bpe

    tokenizer, saved = train_bpe("hello world this is a tiny corpus for a tokenizer " * 50, 300)
    (tmp_path / "tokenizer.json").write_text(saved)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512}))
    data = tmp_path / "lines.txt"
    data.write_text("hello world\nthis is a longer line of text here\n\nshort\n")
    expected = [len(tokenizer.encode(line)) for line in ("hello world", "this is a longer line of text here", "short")]
    assert data_lengths(str(data), model=f"hf:{tmp_path}") == expected == [2, 24, 4]


def test_the_replay_orders_and_which_one_ends_worst():
    """--replay-order worst: the same steps ascending by length, and longest-shortest alternating; a replay
    that runs out is worse than one that fits only with expandable segments, which is worse than one that
    fits; between equals, the one that leaves the most reserved but unallocated."""
    from batchfit.estimator.churn import Churn, Replay, StepMemory, badness, reordered

    shapes = [Shape(4, n) for n in (37, 65, 25, 50, 22)]
    assert [s.length for s in reordered(shapes, "ascending")] == [22, 25, 37, 50, 65]
    assert [s.length for s in reordered(shapes, "alternating")] == [65, 22, 50, 25, 37]
    assert reordered(shapes, "data") == shapes

    def run(first_oom: int | None, expandable_oom: int | None, cached: int) -> Churn:
        steps = [StepMemory(0, 4, 22, 0, 0, 0, cached)]
        return Churn(4, Replay("default", steps, first_oom), Replay("expandable", steps, expandable_oom))

    ranked = sorted([run(None, None, 9), run(3, None, 1), run(2, 2, 0), run(None, None, 1)], key=badness)
    assert [(r.default.first_oom_step, r.expandable.first_oom_step, badness(r)[1]) for r in ranked] == [
        (None, None, 1), (None, None, 9), (3, None, 1), (2, 2, 0)]
    with pytest.raises(OptionError, match="give `replay_steps` K too"):
        check_run_flags("d.jsonl", None, None, None, 0, "worst")
    with pytest.raises(OptionError, match="`replay_order` backwards"):
        check_run_flags("d.jsonl", None, None, None, 5, "backwards")


def test_plan_and_probe_run_every_step_at_the_datas_longest_row(tmp_path):
    """plan / probe --data: no step of the data makes a row longer than the longest sample (pad-longest, each
    sample cut at --seq-len), MAXLEN (pack) or the model's length (pad-max); a token budget is refused."""
    from batchfit.estimator.batching import longest_row
    from batchfit.estimator.run import data_row_length

    assert longest_row(LENGTHS, Batching("pad-longest"), None) == 20
    assert longest_row([min(n, 8) for n in LENGTHS], Batching("pad-longest"), 8) == 8
    assert longest_row(LENGTHS, Batching("pack", 16), None) == 16
    assert longest_row(LENGTHS, Batching("pad-max"), 32) == 32
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"n": n}) + "\n" for n in LENGTHS))
    row, section = data_row_length(str(path), Batching("pad-longest"), model="gpt-tinystories-22m", seq_len=12,
                                   length_column="n")
    assert row == 12 and section["samples"] == 7 and section["lengths"]["max"] == 12
    with pytest.raises(OptionError, match="plan with `batching` pack:64"):
        data_row_length(str(path), Batching("tokens", 64), model="gpt-tinystories-22m", length_column="n")
    for command in ("plan", "probe"):  # probe finds the batch that survives the same row on a real device
        result = CliRunner().invoke(app, [command, "gpt-tinystories-22m", "--gpu-memory", "24GiB", "--batching",
                                          "pack:64"])
        assert result.exit_code != 0 and "give --data PATH too" in result.output
    from batchfit.config.trainer import data_rows

    assert data_rows("gpt-tinystories-22m", 12, None, str(path), None, "n", None) == (row, section)
    assert data_rows("gpt-tinystories-22m", 12, None, None, None, None, None) == (12, None)


def test_bench_runs_every_batch_at_the_datas_longest_row(tmp_path):
    """bench --data (the options estimate, probe and plan declare): 19 samples of 12 tokens and one of 40,
    pad-longest: the batch that holds the 40 is the run's worst step, so each batch size is benched there."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"n": 40 if i == 13 else 12}) + "\n" for i in range(20)))
    out = tmp_path / "b.json"
    result = CliRunner().invoke(app, ["bench", "tests/cpu_truth.py:one_block_tinystories", "--device",
                                      "virtual:rtx4090-24gb", "--batch-sizes", "2", "--data", str(path),
                                      "--length-column", "n", "--json", str(out), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["data"]["traced_length"] == 40 and data["tokens_per_sample"] == 40
    assert data["data"]["lengths"]["median"] == 12
    assert "every step at 40 tokens per row" in " ".join(result.output.split())
