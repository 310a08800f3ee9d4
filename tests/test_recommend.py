"""batchfit recommend: exact branches (k = 1 repeats the parent bit for bit), the checks
before any training, the priors' arithmetic, and a whole small recommendation whose branches
run as jobs of the executors into the runs store (killed and resumed; on Ray).

Checked against the parent run trained for real on the CPU (a branch at k = 1 repeats it bit for bit)
and the priors' formulas worked out by hand."""

from __future__ import annotations

import pytest
import torch

from batchfit import load_workload
from batchfit.errors import UsageError
from batchfit.recommend.branch import Curve, Trainer
from batchfit.recommend.engine import RecommendConfig, evaluator, plan_recommend, run_recommend
from batchfit.recommend.priors import power_lines, step_law
from batchfit.recommend.read import extrapolate, power_exponent
from batchfit.report.recommend_markdown import recommend_markdown
from batchfit.runs.budget import Schedule
from batchfit.runs.data import BatchSource, tokenize
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions
from tiny import write_corpus, write_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recommend")
    workload = load_workload(write_tiny(folder))
    tokens = tokenize(str(write_corpus(folder / "stories.txt", lines=1500)), tokenizer="bytes", vocab_size=320,
                      cache_dir=folder / "cache")
    return workload, tokens


def test_a_branch_at_k_1_repeats_the_parent_bit_for_bit(tiny):
    workload, tokens = tiny
    source = BatchSource(workload, seed=0, tokens=tokens, eval_samples=4)
    torch.manual_seed(0)
    step = TrainingStep(workload, StepOptions(), torch.device("cpu"))
    trainer = Trainer(step, source, Schedule(total=64 * 16, warmup=16), per_sample=16, grad_clip=1.0,
                      evaluate=evaluator(workload, source, 4, step.device, step.forward_autocast))
    parent = Curve(batch_size=2, lr=3e-3, start_samples=0)
    at = trainer.train(parent, start=0, samples=8, micro=2)
    snap = trainer.snapshot(at)
    trainer.train(parent, start=at, samples=8, micro=2, eval_at={at + 8})
    after = {k: v.clone() for k, v in step.model.state_dict().items()}
    moments = [t.clone() for s in step.optimizer.state_dict()["state"].values() for t in s.values()]
    trainer.restore(snap)
    branch = Curve(batch_size=2, lr=3e-3, start_samples=at)
    trainer.train(branch, start=at, samples=8, micro=2, eval_at={at + 8})
    assert branch.train == parent.train[4:]  # the same losses, bit for bit
    assert branch.val == parent.val
    assert all(torch.equal(v, after[k]) for k, v in step.model.state_dict().items())
    assert all(torch.equal(t, m) for t, m in zip(
        (t for s in step.optimizer.state_dict()["state"].values() for t in s.values()), moments))


def test_checks_come_before_any_training(tiny):
    workload, tokens = tiny
    with pytest.raises(UsageError, match="data too short for the budget"):
        plan_recommend(RecommendConfig(batch_sizes=[1, 2], tokens=16 * 2**16), workload, tokens)
    with pytest.raises(UsageError, match="even at micro-batch 1"):
        plan_recommend(RecommendConfig(batch_sizes=[1, 2], tokens=16 * 1024), workload, tokens,
                       largest_fitting=lambda b: 0)
    plan = plan_recommend(RecommendConfig(batch_sizes=[1, 2, 4], tokens=16 * 1024), workload, tokens,
                          largest_fitting=lambda b: 2)
    assert plan.micro_batches == {1: 1, 2: 2, 4: 2}


def test_step_law_at_its_published_test_point():
    # 1B parameters, 100B tokens (the paper's test point): the formula by hand.
    prior = step_law(10**9, 10**11, 2048)
    assert prior.batch_tokens == pytest.approx(0.58 * 1e11 ** 0.571)
    assert prior.batch_tokens == pytest.approx(1.107e6, rel=1e-3)
    assert prior.lr == pytest.approx(1.79 * 1e9 ** -0.713 * 1e11 ** 0.307)
    assert prior.lr == pytest.approx(1.631e-3, rel=1e-3)
    assert prior.batch_size == pytest.approx(prior.batch_tokens / 2048)
    assert "extrapolation" in " ".join(step_law(40_000, 10**6, 16).notes)


def test_power_lines_at_the_values_quoted_from_it():
    # "B_opt = 0.0306*D^0.383 (B in 2048-token sequences), giving 0.721M tokens at D=40e9".
    prior = power_lines(10**9, 40 * 10**9, 2048)
    assert prior.batch_tokens == pytest.approx(0.0306 * 40e9 ** 0.383 * 2048)
    assert prior.batch_tokens == pytest.approx(0.721e6, rel=1e-3)
    assert prior.batch_size == pytest.approx(prior.batch_tokens / 2048)
    assert prior.weight_decay is None  # no batch and rate to set it for
    # tau_opt = 1.084 TPP^-0.527: about 1 at 1 TPP, about 0.03 at 1000 TPP (the paper's reading).
    # At 20 TPP (Chinchilla), 512 sequences of 2048 at lr 1e-3 on D = 20N tokens:
    # weight_decay = B / (lr tau D) = 512 / (1e-3 x 1.084 x 20^-0.527 x (20e9 / 2048)).
    prior = power_lines(10**9, 20 * 10**9, 2048, batch_size=512, lr=1e-3)
    tau = 1.084 * 20 ** -0.527
    assert tau == pytest.approx(0.2236, rel=1e-3)
    assert prior.weight_decay == pytest.approx(512 / (1e-3 * tau * 20e9 / 2048))
    assert prior.weight_decay == pytest.approx(0.2345, rel=1e-3)
    assert 1.084 * 1000 ** -0.527 == pytest.approx(0.0285, rel=1e-2)
    assert not any("extrapolation" in n for n in prior.notes)
    small = " ".join(power_lines(40_000, 10**7, 16).notes)  # 250 TPP inside, 40k parameters not
    assert "outside the fitted 111M-3.3B" in small and "20-1280" not in small
    small = " ".join(power_lines(40_000, 10**6 // 2, 16).notes)  # 12.5 TPP
    assert "outside the fitted 111M-3.3B" in small and "outside the fitted 20-1280" in small


def test_extrapolation_is_a_power_law():
    val = [(100, 2.0), (200, 2.0 * 2 ** -0.5)]
    assert power_exponent(val) == pytest.approx(-0.5)
    assert extrapolate(val, 800, -0.5) == pytest.approx(2.0 * 8 ** -0.5)
    assert extrapolate(val, 800, -0.5, position=100) == pytest.approx(2.0 * 2 ** -0.5 * 8 ** -0.5)
    assert power_exponent([(100, 1.0), (200, -0.5)]) == 0.0  # not a power law: carried flat


SMALL = dict(batch_sizes=[1, 2, 4], tokens=16 * 800, lrs=[3e-3], branch_points=(0.1, 0.2), window=0.05,
             eval_samples=4, max_share=0.25)


@pytest.fixture(scope="module")
def small(tiny):
    workload, tokens = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the autouse one_thread
    plan = plan_recommend(RecommendConfig(**SMALL), workload, tokens)
    result = run_recommend(plan, workload, tokens)
    torch.set_num_threads(threads)
    return plan, result


KILLED = """
import os, signal, sqlite3, sys
import torch
from batchfit import load_workload
from batchfit.recommend.engine import RecommendConfig, plan_recommend, run_recommend
from batchfit.runs.data import open_tokens
from batchfit.train.step import TrainingStep
torch.set_num_threads(1)
spec, cache, store, config = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
workload, tokens = load_workload(spec), open_tokens(__import__("pathlib").Path(cache))
plan = plan_recommend(RecommendConfig(**config), workload, tokens)
step, steps = TrainingStep.step, [0]
def stop(self, *args, **kwargs):  # a real kill -9, three steps into the fifth branch
    out = step(self, *args, **kwargs)
    if os.path.exists(store):
        with sqlite3.connect(store) as db:
            done = db.execute("SELECT COUNT(*) FROM runs WHERE branch != '' AND status = 'done'").fetchone()[0]
        if done >= 4:
            steps[0] += 1
            if steps[0] >= 3:
                os.kill(os.getpid(), signal.SIGKILL)
    return out
TrainingStep.step = stop
run_recommend(plan, workload, tokens, store=store)
"""


def comparable(result) -> dict:
    data = result.to_json()
    data.pop("seconds")
    return data


def test_kill_9_during_a_branch_then_resume_gives_the_same_result(tiny, small, tmp_path):
    import sqlite3
    import subprocess
    import sys

    workload, tokens = tiny
    plan, whole = small
    spec = next(tokens.folder.parent.parent.glob("*.py"))  # the tiny GPT beside the token cache
    store = tmp_path / "recommend.db"
    done = subprocess.run([sys.executable, "-c", KILLED, f"{spec}:workload", str(tokens.folder), str(store),
                           repr(SMALL)], env={**__import__("os").environ, "PYTHONPATH": "src"}, capture_output=True,
                          text=True)
    assert done.returncode == -9, done.stderr
    with sqlite3.connect(store) as db:  # killed mid-way: 4 branches done, the fifth running
        status = dict(db.execute("SELECT status, COUNT(*) FROM runs WHERE branch != '' GROUP BY status").fetchall())
    assert status["done"] == 4 and status["running"] == 1
    resumed = run_recommend(plan, workload, tokens, store=store)
    assert comparable(resumed) == comparable(whole)


@pytest.mark.slow
def test_branches_on_a_local_ray_cluster_give_the_same_result(tiny, small, tmp_path, monkeypatch):
    pytest.importorskip("ray")
    import os
    from pathlib import Path

    workload, tokens = tiny
    plan, whole = small
    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    spec = next(tokens.folder.parent.parent.glob("*.py"))
    said = []
    on_ray = run_recommend(plan, workload, tokens, store=tmp_path / "r.db", executor="ray", workers=2,
                           model=f"{spec}:workload", progress=said.append)
    assert sum("queued on Ray" in m for m in said) == 9  # every branch a Ray task
    a, b = comparable(on_ray), comparable(whole)
    assert a["recommended_batch_size"] == b["recommended_batch_size"]
    assert [r["window_val"] for r in a["branches"]] == pytest.approx([r["window_val"] for r in b["branches"]],
                                                                     rel=1e-5)


def test_a_small_recommendation(small):
    plan, result = small
    data = result.to_json()
    assert data["recommended_batch_size"] in (1, 2, 4)
    low, high = data["recommended_interval"]
    assert low <= data["recommended_batch_size"] <= high
    assert data["choice_rule"].startswith("the lowest extrapolated validation loss")
    # trained: the parent to 160 samples, 3 windows x 3 batch sizes x 40 samples; validated: the parent
    # at 0, 80 and 160, every branch at its window's end, 4 samples each: 12 x 4 samples; 16 tokens each.
    assert (plan.points, plan.window_samples) == ([80, 160], 40)
    assert data["cost_val_tokens"] == 12 * 4 * 16
    assert data["cost_tokens"] == (160 + 3 * 3 * 40) * 16 + 12 * 4 * 16
    # the sweep: 3 runs of 12,800 tokens, each validated at step 0 and at every 10% (11 times), 4 samples each
    assert data["sweep_val_tokens"] == 3 * 11 * 4 * 16
    assert data["sweep_tokens_equivalent"] == 3 * 16 * 800 + 3 * 11 * 4 * 16
    assert data["cost_share_of_sweep"] < 0.3
    assert {r["kind"] for r in result.evidence()} >= {"measured", "prior (formula)"}
    # Power Lines' weight decay at the recommended batch and rate, by hand: B / (lr tau D) in samples,
    # tau = 1.084 (D / N)^-0.527 with N every parameter of the model
    lines = next(p for p in data["sources"]["priors"] if p["source"].startswith("Power Lines"))
    tau = 1.084 * (data["budget"] / data["params"]) ** -0.527
    by_hand = data["recommended_batch_size"] / (data["lr"] * tau * data["budget"] / 16)
    assert lines["weight_decay"] == pytest.approx(by_hand)
    assert "Weight decay" in recommend_markdown(data)


def test_validation_is_counted_by_hand(tiny):
    workload, tokens = tiny
    plan = plan_recommend(RecommendConfig(**{**SMALL, "evals_per_window": 4}), workload, tokens)
    # the parent at 0, 80 and 160 samples; each of 3 windows x 3 batch sizes at 10, 20, 30 and 40 samples
    # into its 40-sample window (at batch 4: 8, 20, 28, 40, whole steps): 3 + 36 passes of 4 samples
    assert plan.val_samples == (3 + 36) * 4
    # the sweep at --eval-every 10%: step 0 and each tenth of 800 samples, at every batch size
    assert plan.sweep_val_samples() == 3 * 11 * 4


def test_a_diverging_branch_says_its_loss_is_not_finite():
    """SGD at lr 1 without clipping on a regression whose targets grow with the inputs: the loss goes to
    inf within a few steps. The runs store keeps a NaN or inf as NULL, which its curve refused (an
    IntegrityError when the branch was written back): the branch stops there, saying so."""
    from torch import nn

    from batchfit import Workload
    from batchfit.train.oom import NonFiniteLoss

    diverging = Workload(name="diverging", build_model=lambda: nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 1)),
                         make_batch=lambda b, device: torch.randn(b, 8, device=device),
                         loss_fn=lambda m, x: (m(x).squeeze(-1) - x.sum(-1)).pow(2).mean(),
                         build_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    torch.manual_seed(0)
    step = TrainingStep(diverging, StepOptions(), torch.device("cpu"))
    source = BatchSource(diverging, seed=0, tokens=None, eval_samples=4)
    trainer = Trainer(step, source, Schedule(total=64, warmup=0), per_sample=1, grad_clip=None,
                      evaluate=evaluator(diverging, source, 2, step.device, step.forward_autocast))
    curve = Curve(batch_size=2, lr=1.0, start_samples=0)
    with pytest.raises(NonFiniteLoss, match=r"the training loss is not finite \((inf|nan)\) at sample \d+ \(batch 2"):
        trainer.train(curve, start=0, samples=64, micro=2)
    assert curve.train and all(loss == loss and abs(loss) < float("inf") for _, loss in curve.train)  # kept, finite


def test_the_plan_fits_the_budget_and_grid_by_hand():
    """Issue 33's refused case, in samples: grid 1-64, a budget of 512 samples (65,536 tokens of
    128), --window 4% (20 samples: no whole step at 64). The sweep trains 7 x 512 = 3,584."""
    from batchfit.recommend.layout import lay_out

    ask = dict(point_shares=(0.1, 0.25), window_share=0.04, seeds=2, rates=1)
    layout = lay_out(512, [1, 2, 4, 8, 16, 32, 64], max_share=0.2, **ask)
    # every size: window 2 x 64 = 128, parent to 128, 3 windows x 7 sizes: 128 + 2,688 = 2,816 (79%);
    # the last point only: 128 + 2 x 7 x 128 = 1,920 (54%); without 64 (window 64): 128 + 3 x 6 x 64 =
    # 1,280 (36%), last point only 896 (25%); without 32 and 64 (window 32): 128 + 3 x 5 x 32 = 608 (17%)
    assert (layout.mode, layout.batch_sizes, layout.points, layout.window) == ("branch", (1, 2, 4, 8, 16), (51, 128),
                                                                               32)
    assert (layout.trained, layout.sweep_trained) == (608, 3584)
    assert any("32, 64 not branched" in n for n in layout.notes)
    # no aim reachable: the cheapest plan still beats the sweep, and runs: batch 1-4 (window 20, the 4%
    # asked), the last point only: 128 + 2 x 3 x 20 = 248 (7%)
    cheapest = lay_out(512, [1, 2, 4, 8, 16, 32, 64], max_share=0.01, **ask)
    assert (cheapest.batch_sizes, cheapest.points, cheapest.window, cheapest.trained) == ((1, 2, 4), (128,), 20, 248)
    # two sizes, 32 samples: 2 steps at 8 in each of 2 windows need 32 samples after the first step at 1:
    # no branch plan fits, so the sweep itself runs (2 x 32 samples), never more
    sweep = lay_out(32, [1, 8], max_share=0.2, **ask)
    assert (sweep.mode, sweep.points, sweep.window, sweep.trained, sweep.sweep_trained) == ("sweep", (0,), 32, 64, 64)


def test_the_budget_the_issue_refused_runs_for_less_than_the_sweep(tiny):
    """Grid 1-64 at 512 samples (the issue's 65,536 tokens of 128; here 16 tokens a sample)."""
    workload, tokens = tiny
    # epsilon 20%: the five branched batch sizes end within 8% of one another here, so the interval
    # reaches the largest one branched, and the result says the unbranched ones may be as good
    plan = plan_recommend(RecommendConfig(batch_sizes=[1, 2, 4, 8, 16, 32, 64], tokens=512 * 16, lrs=[3e-3],
                                          eval_samples=4, epsilon=0.2), workload, tokens)
    result = run_recommend(plan, workload, tokens)
    sweep_trained = 7 * 512 * 16  # tokens: every batch size on the whole budget
    trained = result.cost - result.cost_val
    assert trained == (128 + 3 * 5 * 32) * 16 <= sweep_trained / 5
    assert result.total_cost <= result.sweep_equivalent
    assert result.branched == [1, 2, 4, 8, 16] and result.recommended_batch_size in result.branched
    assert result.interval == (1, 16) and any("reaches 16, the largest batch branched" in n for n in result.notes)
    assert any("spans more than 4x" in n for n in result.notes)


def test_where_branching_cannot_cost_less_the_sweep_runs(tiny):
    workload, tokens = tiny
    plan = plan_recommend(RecommendConfig(batch_sizes=[1, 8], tokens=32 * 16, lrs=[3e-3], eval_samples=4),
                          workload, tokens)
    assert (plan.mode, plan.points, plan.window_samples, plan.cost_samples) == ("sweep", [0], 32, 64)
    result = run_recommend(plan, workload, tokens)
    final = {c["batch_size"]: c["val"][-1][1] for c in result.curves}
    assert result.recommended_batch_size == min(final, key=final.get)
    assert result.extrapolated == pytest.approx(final)  # read at the budget: nothing carried
    assert result.cost - result.cost_val == 2 * 32 * 16 and result.total_cost <= result.sweep_equivalent
    assert any("ran the sweep itself" in n for n in result.notes)
    assert result.choice_rule.startswith("the lowest final validation loss")


def test_the_command_keeps_the_noise_scale_within_the_aim(tiny, tmp_path):
    """Through the command, the noise scale on (its default), batch 1-8 at 128 samples: the plan
    branches 1-4 at the last point (32 + 2 x 3 x 8 = 80 samples trained, 8 passes of 4 validated);
    8 noise repeats at batch 8 (64 samples, 1,024 tokens) would take it past 20% of the sweep's; they
    are left out, saying so."""
    import json

    from typer.testing import CliRunner

    from batchfit.cli.app import app

    _, tokens = tiny
    folder = tokens.folder.parent.parent
    spec = next(folder.glob("*.py"))
    out = tmp_path / "r.json"
    done = CliRunner().invoke(app, ["recommend", f"{spec}:workload", "--data", str(folder / "stories.txt"),
                                    "--tokenizer", "bytes", "--cache-dir", str(folder / "cache"), "--tokens", "2048",
                                    "--batch-sizes", "1,2,4,8", "--lrs", "3e-3", "--eval-samples", "4",
                                    "--json", str(out), "--out", str(tmp_path / "report")])
    assert done.exit_code == 0, done.output
    data = json.loads(out.read_text())
    assert data["noise_cost"] == 0 and data["sources"]["noise"] is None
    assert any(n.startswith("noise scale not measured: its 1,024 tokens") for n in data["notes"])
    assert data["cost_tokens"] == (80 + 8 * 4) * 16 and data["cost_share_of_sweep"] <= 0.2
