"""Exact budgets: steps = budget / (batch x seq) at every batch size, or a refusal that
names the nearest budgets that divide; the schedule is a function of tokens.

Checked against arithmetic worked out by hand."""

from __future__ import annotations

import math

import pytest

from batchfit.errors import OptionError
from batchfit.runs.budget import Budget, Schedule, parse_amount, parse_count, parse_lrs, scaled_lr

SEED_002_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_seed_002_budget_is_exact_at_every_batch_size():
    # 327.68M tokens of 256-token samples = 1,280,000 samples; 1,280,000 / b steps.
    budget = Budget(unit="tokens", total=parse_count("327.68M", "--tokens"), tokens_per_sample=256)
    steps = budget.check(SEED_002_SIZES)
    assert steps == {1: 1_280_000, 2: 640_000, 4: 320_000, 8: 160_000, 16: 80_000, 32: 40_000, 64: 20_000,
                     128: 10_000, 256: 5_000, 512: 2_500}
    for b, n in steps.items():
        assert n * b * 256 == 327_680_000


def test_sample_budget():
    budget = Budget(unit="samples", total=parse_count("200k", "--samples"), tokens_per_sample=None)
    assert budget.check([4, 16, 64]) == {4: 50_000, 16: 12_500, 64: 3_125}


def test_a_budget_that_does_not_divide_is_refused_with_the_nearest_exact_ones():
    # batch 8 x seq 16 = 128 tokens per step; lcm(2 x 16, 8 x 16) = 128; 1000 lies between 896 and 1024.
    budget = Budget(unit="tokens", total=1000, tokens_per_sample=16)
    with pytest.raises(OptionError, match=r"batch size 2 .*multiples of 128, e.g. `tokens` 896 or 1024"):
        budget.check([2, 8])
    with pytest.raises(OptionError, match="not a whole number of steps at batch size 8"):
        budget.steps(8)


def test_a_batch_above_the_budget_is_refused():
    budget = Budget(unit="tokens", total=64, tokens_per_sample=16)
    assert budget.steps(4) == 1
    with pytest.raises(OptionError, match="batch size 8 is above the budget: one step takes 128 tokens"):
        budget.check([4, 8])


@pytest.mark.parametrize("text", ["0", "0M"])
def test_zero_budget_is_refused(text):
    with pytest.raises(OptionError, match="`tokens` must be 1 or more"):
        Budget(unit="tokens", total=parse_count(text, "--tokens"), tokens_per_sample=16)


def test_counts_and_amounts():
    assert parse_count("327.68M", "--tokens") == 327_680_000
    assert parse_count("2e5", "--samples") == 200_000
    assert parse_amount("1%", 327_680_000, "--warmup") == 3_276_800
    assert parse_amount("0.25", 1000, "--warmup") == 250
    assert parse_amount("2M", 327_680_000, "--warmup") == 2_000_000
    with pytest.raises(OptionError, match="327.68M"):
        parse_count("lots", "--tokens")
    with pytest.raises(OptionError, match="between 0% and 100%"):
        parse_amount("150%", 1000, "--warmup")


def test_schedule_in_tokens_is_the_same_at_every_batch_size():
    schedule = Schedule(total=1000, warmup=100, min_lr_ratio=0.1)
    assert schedule.factor(50) == 0.5                      # half-way through warmup
    assert schedule.factor(100) == 1.0                     # the peak
    assert math.isclose(schedule.factor(550), 0.55)        # half-way down the cosine: 0.1 + 0.9 x 0.5
    assert math.isclose(schedule.factor(1000), 0.1)        # the floor at the end of the budget
    # batch 2 and batch 8 (x 16 tokens) read the same curve at the tokens their steps end at
    assert schedule.factor(2 * 16 * 5) == schedule.factor(8 * 16 * 1 + 32)


def test_learning_rate_scaling():
    assert scaled_lr(3e-4, 32, "none", 8) == 3e-4
    assert math.isclose(scaled_lr(3e-4, 32, "sqrt", 8), 6e-4)
    assert math.isclose(scaled_lr(3e-4, 32, "linear", 8), 1.2e-3)
    assert parse_lrs("1e-3,1e-4,3e-4") == [1e-4, 3e-4, 1e-3]
    with pytest.raises(OptionError, match="positive"):
        parse_lrs("0,1e-3")
