"""The gradient noise scale recovers B_simple where it is known in closed form.

Problem: loss(w; x) = |w - x|^2 / 2 with samples x ~ N(mu, Sigma), mu = (3, 4),
Sigma = 50 I (2 x 2). The per-sample gradient is w - x: at w = 0 its mean is G = -mu and its
covariance is Sigma, so |G|^2 = 9 + 16 = 25, tr(Sigma) = 100 and B_simple = 100 / 25 = 4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.runs.data import BatchSource
from batchfit.sweep.noise import gradient_noise_scale, ratio_interval, t_quantile, unbiased
from batchfit.workload import Workload

MU = torch.tensor([3.0, 4.0])
STD = math.sqrt(50.0)


class Point(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


def quadratic() -> Workload:
    return Workload(name="quadratic", build_model=Point,
                    make_batch=lambda b, device: MU + STD * torch.randn(b, 2, device=device),
                    loss_fn=lambda model, x: 0.5 * (model.w - x).pow(2).sum(dim=1).mean(),
                    build_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_the_unbiased_estimators_invert_the_expected_norms():
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B: 25 + 100/8 = 37.5 and 25 + 100/128 = 25.78125
    g2, trace = unbiased(37.5, 25.78125, 8, 128)
    assert g2 == pytest.approx(25.0, abs=1e-12)
    assert trace == pytest.approx(100.0, abs=1e-12)


def test_noise_scale_recovers_a_known_b_simple_at_the_initial_point():
    workload = quadratic()
    result = gradient_noise_scale(workload, BatchSource(workload, seed=0), small=4, big=32, steps=0, repeats=200)
    assert result.g2 == pytest.approx(25.0, rel=0.1)
    assert result.trace == pytest.approx(100.0, rel=0.1)
    assert result.b_simple == pytest.approx(4.0, rel=0.1)
    low, high = result.b_simple_interval
    assert low < 4.0 < high and high - low < 2.0
    data = result.to_json()
    assert data["b_simple"] == result.b_simple and len(data["measurements"]) == 200
    assert data["data"] == "synthetic" and any("synthetic" in n for n in data["notes"])


def test_noise_scale_grows_as_training_approaches_the_minimum():
    # At the minimum G -> 0 while tr(Sigma) stays 100: B_simple = 100 / |w - mu|^2 grows.
    workload = quadratic()
    result = gradient_noise_scale(workload, BatchSource(workload, seed=0), small=2, big=32, steps=60, ema_beta=0.9)
    assert len(result.measurements) == 60
    assert result.trace == pytest.approx(100.0, rel=0.3)
    assert result.b_simple > 4 * 4.0
    assert result.lr == 0.1


@pytest.mark.parametrize("dof, exact", [(1, 6.3138), (2, 2.9200), (3, 2.3534), (4, 2.1318), (9, 1.8331), (30, 1.6973)])
def test_t_quantile_matches_the_tables(dof, exact):
    assert t_quantile(0.95, dof) == pytest.approx(exact, rel=3e-3)  # Student t, 95th percentile


def test_interval_of_constant_measurements_is_a_point():
    assert ratio_interval([25.0] * 5, [100.0] * 5) == (4.0, 4.0)


def analytic_measurements(rng: np.random.Generator, small: int, big: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n measurements of (|G|^2, tr(Sigma)) on the quadratic at w = 0, drawn directly: the
    per-sample gradient is w - x = -x, a micro-batch's gradient the mean over its samples
    (what measure_once computes with backward, without training anything)."""
    x = MU.numpy() + STD * rng.standard_normal((n, big // small, small, 2))
    micro = x.mean(axis=2)
    g_small_sq = (micro ** 2).sum(-1).mean(-1)
    g_big_sq = (micro.mean(axis=1) ** 2).sum(-1)
    return unbiased(g_small_sq, g_big_sq, small, big)


@pytest.mark.parametrize("small, big, n", [(2, 8, 10), (4, 32, 8), (4, 32, 32), (8, 64, 100)])
def test_the_90_percent_interval_covers_the_true_b_simple_about_90_percent_of_the_time(small, big, n):
    # True B_simple = 100 / 25 = 4. Over 400 seeds, a 90% interval covers it 360 times
    # give or take 6 (binomial sd): the bootstrap covered 335 (2,8,10) and 333 (4,32,8) times.
    seeds = 400
    covered = inside = 0
    for seed in range(seeds):
        g2, trace = analytic_measurements(np.random.default_rng(seed), small, big, n)
        low, high = ratio_interval(g2, trace)
        covered += low <= 4.0 <= high
        inside += low <= trace.mean() / g2.mean() <= high
    assert 0.86 <= covered / seeds <= 0.96
    assert inside == seeds  # the figure is always inside its own interval


def test_the_interval_is_unbounded_when_the_gradient_is_lost_in_noise():
    # |G|^2 measurements centred on 0: no upper bound on B_simple can be claimed.
    low, high = ratio_interval([1.0, -1.0, 2.0, -2.0], [100.0, 90.0, 110.0, 100.0])
    assert (low, high) == (-math.inf, math.inf)


def test_while_training_the_figure_and_its_interval_come_from_the_same_window():
    # Item 19: the figure was the EMA (lagging), its interval a bootstrap of the last window.
    workload = quadratic()
    result = gradient_noise_scale(workload, BatchSource(workload, seed=0), small=2, big=16, steps=50, ema_beta=0.9)
    window = result.measurements[-10:]
    g2 = sum(m.g2 for m in window) / 10
    trace = sum(m.trace for m in window) / 10
    assert result.b_simple == pytest.approx(trace / g2, rel=1e-12)
    low, high = result.b_simple_interval
    assert low <= result.b_simple <= high
    assert any("last 10 steps" in note for note in result.notes)


@pytest.mark.parametrize("small, big, steps, repeats, message", [
    (8, 100, 0, 10, "must be a multiple of the small one.*`batch_sizes` 8,96"),
    (8, 12, 0, 10, "`batch_sizes` 8,16"),  # it suggested 8,8, which it then refused
    (8, 8, 0, 10, "small then big"),
    (8, 64, 0, 1, "`repeats` 2 or more"),
    (8, 64, -1, 10, "`steps` must be 0"),
])
def test_bad_noise_options(small, big, steps, repeats, message):
    workload = quadratic()
    with pytest.raises(OptionError, match=message):
        gradient_noise_scale(workload, BatchSource(workload, seed=0), small=small, big=big, steps=steps,
                             repeats=repeats)


def test_the_report_names_an_unbounded_interval():
    from batchfit.report.sweep_markdown import noise_line

    noise = {"b_simple": 12.0, "b_simple_interval": [None, None], "steps": 0, "repeats": 4, "ema_beta": 0.95,
             "batch_sizes": [2, 8], "seconds": 1.0}
    assert "B_simple = 12.0 samples (90% interval unbounded" in noise_line(noise)
    noise["b_simple_interval"] = [3.0, 5.0]
    assert "B_simple = 12.0 samples (90% interval 3.0 to 5.0), from batch sizes 2 and 8" in noise_line(noise)


def test_an_interval_whose_lower_root_is_negative_starts_at_0():
    """B_simple = tr(Sigma) / |G|^2 cannot be negative: when the trace is not clearly above 0,
    Fieller's lower root is negative and the reported interval starts at 0 (it still holds the figure)."""
    from batchfit.sweep.noise import Measurement, ratio_interval, summarize

    g2, trace = [1.0, 1.1, 0.9, 1.0], [4.0, -3.0, 5.0, -2.0]  # tr mean 1.0, its spread larger than that
    assert ratio_interval(g2, trace)[0] < 0
    measurements = [Measurement(i, 0.0, 0.0, g, t, None) for i, (g, t) in enumerate(zip(g2, trace))]
    b, (low, high), *_ = summarize(measurements, steps=0, ema_beta=0.9)
    assert b == 1.0 and low == 0.0 and high > b
