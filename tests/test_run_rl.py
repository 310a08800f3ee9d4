"""RL steps over the run (issue 32, item 2): each phase of a GRPO step (generation with a KV cache,
the reference log-probs, the train update) has its own peak, the largest decides and is named;
``--trainer`` reads a TRL GRPOConfig's generation settings.

Truth: the torch profiler's memory timeline of a REAL GRPO step of a transformers Llama (hidden 32,
2 layers, vocabulary 256) on this CPU, cut at the phases the step announces
(``cpu_truth.profiled_phase_peaks``), against the trace's peak of each phase.

Checked against batchfit's own GRPO step (zoo/grpo.py, TRL's GRPOTrainer in its memory-deciding parts) running for
real under the profiler (checks the counting, not the fidelity to TRL's trainer).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from tests.cpu_truth import profiled_peak, profiled_phase_peaks  # noqa: E402

from batchfit.cli.app import app  # noqa: E402
from batchfit.errors import OptionError  # noqa: E402
from batchfit.integrations.trainer_args import from_training_arguments  # noqa: E402
from batchfit.options import Rollout  # noqa: E402
from batchfit.phases import rl_phase_peaks  # noqa: E402
from batchfit.trace.memory import MemoryTracker  # noqa: E402
from batchfit.trace.session import TraceSession  # noqa: E402
from batchfit.train.step import TrainingStep  # noqa: E402
from batchfit.workload import StepOptions  # noqa: E402
from batchfit.zoo.hf_grpo import hf_grpo_workload  # noqa: E402
from batchfit.zoo.hf_ppo import ppo_workload  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_each_phase_peak_is_the_profilers(llama, tmp_path):
    # 4 completions per update, 2 update steps per generation (8 generated, 6 new tokens each), a
    # reference model and the policy's old log-probs, both in the 'reference' phase
    rollout = Rollout(prompt_len=8, new_tokens=6, group_size=2, steps_per_generation=2, old_logprobs=True)
    workload = hf_grpo_workload(llama, rollout)
    torch.manual_seed(0)
    real = profiled_phase_peaks(TrainingStep(workload, StepOptions(), torch.device("cpu")), 4, tmp_path)
    with TraceSession(workload, StepOptions(), cuda_semantics=False) as session:
        traced = session.trace(4).snapshot.peak_by_phase
    for phase in ("generate", "reference", "forward", "backward", "optimizer"):
        assert abs(traced[phase] - real[phase]) <= 128, (phase, traced[phase], real[phase])  # bytes
    peaks = rl_phase_peaks(traced)
    assert peaks["update"] == max(traced["forward"], traced["backward"], traced["optimizer"])


@pytest.mark.slow
def test_each_ppo_phase_peak_against_the_profiler(llama, tmp_path):
    # TRL's PPO step: 4 queries per rollout (2 micro-batches of 2), generated and scored 3 at a time, 6 new
    # tokens whose logits are all kept; two profiled steps: the last rollout's logits, alive until the next
    # rollout replaces them, are freed without an op reading them, which the timeline sees only then
    rollout = Rollout(prompt_len=8, new_tokens=6, group_size=1, steps_per_generation=2, algorithm="ppo", chunk_rows=3)
    workload = ppo_workload(llama, rollout)
    torch.manual_seed(0)
    real = profiled_phase_peaks(TrainingStep(workload, StepOptions(), torch.device("cpu")), 2, tmp_path, steps=2)
    with TraceSession(workload, StepOptions(), cuda_semantics=False) as session:
        traced = session.trace(2).snapshot.peak_by_phase
    for phase in ("generate", "reference", "forward", "backward", "optimizer"):
        assert abs(traced[phase] - real[phase]) <= 128, (phase, traced[phase], real[phase])


def test_logsumexp_counts_what_its_kernel_makes(tmp_path):
    """TRL's log-probs take a logsumexp per row, whose kernel (ATen's logsumexp_out_impl, every device) makes the
    row's max, the result, and the row less its max exponentiated, a tensor the row's size: before they were
    counted the PPO scoring phase traced 6,200 B under the profiler (a [6, 256] fp32 row is 6,144 B). By hand:
    a [10, 100] fp32 input (4,000 B) peaks at 4,000 + 40 + 40 + 4,000 B; the profiler's real step agrees."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), MemoryTracker(round_bytes=1) as tracker:
        x = torch.empty(10, 100)
        torch.logsumexp(x, 1)
        assert tracker.peak_bytes == 8080
    x = torch.randn(10, 100)
    assert profiled_peak(lambda: torch.logsumexp(x, 1), tmp_path) == 8080


def grpo_mapping(**fields):
    return from_training_arguments({"per_device_train_batch_size": 4, **fields}).rollout


def test_grpo_config_fields_and_trl_defaults():
    # TRL's defaults: 8 generations, completions of 512, beta 0 (no reference model), one generation per
    # optimizer step (steps_per_generation = gradient_accumulation_steps); prompts are not cut by TRL's current
    # GRPOConfig, so without max_prompt_length they are traced at 512 tokens, and the mapping says so
    mapping = from_training_arguments({"per_device_train_batch_size": 4, "num_generations": 8,
                                       "gradient_accumulation_steps": 2})
    assert mapping.rollout == Rollout(prompt_len=512, new_tokens=512, group_size=8, steps_per_generation=2,
                                      reference=False)
    assert "give max_prompt_length" in next(u.why for u in mapping.used if u.field == "max_prompt_length")
    # a saved GRPOConfig holds both steps_per_generation and the global generation_batch_size (here from 8
    # processes): the per-device one is read
    assert grpo_mapping(steps_per_generation=2, generation_batch_size=64, num_generations=4).steps_per_generation == 2
    # vLLM's importance-sampling correction (on by default) makes TRL compute the old log-probs
    assert grpo_mapping(num_generations=4, use_vllm=True).old_logprobs
    # generation_batch_size is global: 32 completions / (4 per device x 2 devices) = 4 update steps
    rollout = from_training_arguments({"per_device_train_batch_size": 4, "generation_batch_size": 32,
                                       "num_generations": 4, "beta": 0.04}, world_size=2).rollout
    assert (rollout.steps_per_generation, rollout.reference, rollout.old_logprobs) == (4, True, True)
    assert not from_training_arguments({"per_device_train_batch_size": 4}).rollout  # an SFT config


@pytest.mark.parametrize("fields, words", [
    ({"generation_batch_size": 6, "num_generations": 2}, "multiple of per_device_train_batch_size"),
    ({"num_generations": 3}, "multiple of num_generations"),
    ({"num_generations": 2, "max_prompt_length": None}, "max_prompt_length is null"),
])
def test_bad_rl_args_are_one_line(fields, words):
    with pytest.raises(OptionError, match=words):
        grpo_mapping(**fields)


@pytest.mark.slow
def test_generation_sets_the_peak_and_is_named(llama, tmp_path):
    # 64 update steps of 1 completion of 2 tokens per generation: the KV cache and sampling of 64 rows outweigh one
    # row's update, whose fused LM head holds a 32,768-wide fp32 tile buffer (2 tokens: 256 KiB)
    args = tmp_path / "grpo.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 1, "num_generations": 4, "steps_per_generation": 64,
                                "max_prompt_length": 8, "max_completion_length": 2, "use_vllm": True}))
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["estimate", f"hf:{llama}", "--gpu-memory", "1GiB", "--limit", "allocated",
                                 "--max-batch", "1", "--trainer", str(args), "--json", str(out), "--no-cache",
                                 "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "not used: use_vllm=true (generation in vLLM" in text  # a field not modelled, named
    assert "the generation sets the step's peak" in text
    data = json.loads(out.read_text())
    point = next(p for p in data["points"] if p["batch_size"] == 1)
    phases = data["rl_phases"]
    # beta 0: no reference model; the 'reference' phase holds the policy's old log-probs (a generation
    # serving 64 optimizer steps: TRL computes them)
    assert phases["deciding_phase"] == "generate"
    assert data["trainer"]["rollout"]["reference"] is False and data["trainer"]["rollout"]["old_logprobs"] is True
    assert phases["peak_bytes"]["generate"] == point["peak_by_phase"]["generate"] == point["peak_bytes"]
    assert data["trainer"]["rollout"]["steps_per_generation"] == 64
    assert "## The phases of the RL step" in (tmp_path / "report" / "report.md").read_text()


def test_what_a_grpo_estimate_cannot_take_is_one_line(llama, tmp_path):
    args = tmp_path / "grpo.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "num_generations": 4}))
    for more, words in ((["--emit", f"trainer:{tmp_path / 'x.json'}"], "change the generation batch"),
                        (["--seq-len", "64"], "drop --data, --seq-len")):
        result = runner.invoke(app, ["estimate", f"hf:{llama}", "--gpu-memory", "1GiB", "--trainer", str(args), *more])
        assert result.exit_code != 0 and words in " ".join(result.output.split()), result.output
    for command in (["bench", f"hf:{llama}", "--device", "virtual:a100-40gb"],
                    ["probe", f"hf:{llama}", "--gpu-memory", "1GiB"]):  # they would trace it as SFT: refused
        result = runner.invoke(app, [*command, "--trainer", str(args)])
        assert result.exit_code != 0 and "only estimate traces its RL step" in " ".join(result.output.split())
    result = runner.invoke(app, ["estimate", "gpt2-124m", "--gpu-memory", "1GiB", "--trainer", str(args)])
    assert result.exit_code != 0 and "the step generates with a causal LM" in " ".join(result.output.split())


def test_ppo_config_fields_and_trl_defaults():
    # TRL's PPOConfig: a rollout of per-device 2 x accumulation 4 x 2 mini-batches = 16 queries, 53 new tokens,
    # generated and scored 64 rows at a time (capped at the rollout's 16)
    mapping = from_training_arguments({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                                       "num_mini_batches": 2, "num_ppo_epochs": 4, "reward_model_path": "rm"})
    assert mapping.rollout == Rollout(prompt_len=512, new_tokens=53, group_size=1, steps_per_generation=8,
                                      algorithm="ppo", chunk_rows=16)
    assert "another size there is not traced" in next(u.why for u in mapping.unused if u.field == "reward_model_path")


def test_a_saved_grpo_config_reads_whole(tmp_path):
    """What GRPOConfig(...).to_json_string() writes: TrainingArguments' fields (the real class) and GRPO's own,
    steps_per_generation and generation_batch_size both filled in by its __post_init__: no field is taken for a
    typo, every one is accounted for."""
    pytest.importorskip("accelerate")
    saved = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                           per_device_train_batch_size=4, gradient_accumulation_steps=2).to_dict()
    saved.update(num_generations=8, num_generations_eval=None, max_completion_length=256, generation_batch_size=8,
                 steps_per_generation=2, temperature=1.0, top_p=1.0, beta=0.04, num_iterations=1, use_vllm=False,
                 vllm_importance_sampling_correction=True, entropy_coef=0.0, log_unique_prompts=False,
                 use_transformers_continuous_batching=False, loss_type="dapo", max_prompt_length=128)
    mapping = from_training_arguments(saved)
    assert mapping.rollout == Rollout(prompt_len=128, new_tokens=256, group_size=8, steps_per_generation=2)
    assert {u.field for u in mapping.used} | {u.field for u in mapping.unused} >= set(saved)


@pytest.mark.slow
def test_a_ppo_config_traces_trls_ppo_step(llama, tmp_path):
    args = tmp_path / "ppo.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "num_mini_batches": 2, "response_length": 6,
                                "local_rollout_forward_batch_size": 3, "num_ppo_epochs": 4, "max_prompt_length": 8}))
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["estimate", f"hf:{llama}", "--gpu-memory", "1GiB", "--limit", "allocated",
                                 "--max-batch", "2", "--trainer", str(args), "--json", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["trainer"]["rollout"]["algorithm"] == "ppo" and data["trainer"]["rollout"]["chunk_rows"] == 3
    assert set(data["rl_phases"]["peak_bytes"]) == {"generate", "reference", "update"}
    # policy and value model trained (the same architecture here), reference and reward model frozen
    assert data["trainable_params"] * 2 == data["params"]
    assert any(a["what"].startswith("PPO: one update micro-batch traced") for a in data["approximations"])


def test_plan_refuses_an_rl_step_in_one_line(llama):
    # FSDP2 gathers the policy's shards around the root's forward, not around generation's calls of the
    # policy alone (TRL gathers them itself): refused before anything is traced, not a DTensor error inside
    from batchfit.devices import get_device
    from batchfit.errors import OptionError
    from batchfit.plan.engine import plan
    from batchfit.plan.world import World

    workload = hf_grpo_workload(llama, Rollout(prompt_len=8, new_tokens=2, group_size=2))
    with pytest.raises(OptionError, match="generates \\(an RL step\\): plan does not trace generation"):
        plan(workload, device=get_device("h100-80gb"), worlds=[World(2)], strategies="fsdp")
