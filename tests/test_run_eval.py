"""``estimate --eval-batch-size`` (issue 32, item 2): the eval loop beside the training step.

The truth: a REAL training step then HF Trainer's evaluation loop (``TrainingStep.evaluate``:
model.eval(), no gradients, the whole output kept, the logits of ``held_steps`` steps concatenated)
on this CPU, its allocated peak read by the torch profiler, against the eval window's traced peak
with CPU semantics. The model: batchfit's zoo Llama, d 64, 2 layers, vocab 4,096 (its logits
hold most of an eval step: 8 x 64 x 4,096 x 4 B = 8 MiB per step).

Checked against batchfit's own eval loop (TrainingStep.evaluate, HF Trainer's evaluation loop as it keeps the
logits) running for real under the profiler (checks the counting, not the fidelity to the Trainer's loop).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from batchfit.devices import custom_device
from batchfit.errors import OptionError
from batchfit.estimator.batching import Batching, Shape, step_shapes
from batchfit.estimator.engine import estimate
from batchfit.estimator.eval_phase import EvalTracer, add_eval_phase
from batchfit.estimator.request import EstimateRequest, RunRequest
from batchfit.estimator.run import estimate_run
from batchfit.report.run_markdown import eval_lines, eval_markdown
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import profiled_peak, same_kernels_on_any_x86, tiny_llama_workload


def tiny(seq_len: int | None = None, vocab: int = 4096):
    return tiny_llama_workload(TransformerConfig(vocab_size=vocab, seq_len=seq_len or 64, d_model=64, n_layers=2,
                                                 n_heads=4, d_ff=128, llama=True, tied_embeddings=False))


def test_the_eval_loops_traced_peak_is_the_real_loops_within_one_percent(tmp_path):
    """Measured 2026-11-28: one train step at 2 x 64 tokens, then 3 eval steps of 8 x 64 whose logits
    are held together: traced 57,614,084 B, the profiler 57,614,148 B (the train step alone: 15,056,136 B;
    with one held step, 24,067,848 / 24,067,912 B). The profiler sees both phases, so the eval loop
    must be the larger for its peak to be the eval's: it is, almost four times."""
    device = custom_device(2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracer = EvalTracer(tiny(), lambda n: None, Shape(2, 64), StepOptions(), device, held_steps=3,
                            cuda_semantics=False)
        try:
            traced = tracer.point(Shape(8, 64)).peak_bytes - device.workspace_bytes
            train = tracer.train_peak_bytes - device.workspace_bytes
        finally:
            tracer.close()
        torch.manual_seed(0)
        with same_kernels_on_any_x86():
            step = TrainingStep(tiny(), StepOptions(), torch.device("cpu"))
            step.run(2)  # the optimizer state, as in the trace's first step
            measured = profiled_peak(lambda: (step.run(2), step.evaluate(8, held_steps=3)), tmp_path)
    assert traced > 3 * train
    assert traced == pytest.approx(measured, rel=0.01), f"traced {traced:,} B, measured {measured:,} B"
    assert step.model.training  # evaluate() puts the model back in train mode


def test_the_train_step_fits_and_the_eval_loop_at_its_batch_does_not():
    """Batch 4 trains in this device; an eval batch of 64 (its logits alone 64 x 64 x 4,096 x 4 B = 64 MiB)
    does not, so the answer names the eval step and the largest eval batch that fits (one more does not)."""
    device = custom_device((512 + 64 + 40) * 2**20)  # 40 MiB past the CUDA context and cuBLAS
    workload = tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate(workload, device=device, limit="allocated", batch_sizes=[4], max_batch=4)
        assert result.max_batch_size == 4
        add_eval_phase(result, workload, 64, limit="allocated")
    phase = result.eval_phase
    assert phase.asked.peak_bytes > device.usable_bytes >= phase.train_peak_bytes
    assert not phase.fits and phase.deciding_phase == "eval" and 0 < phase.max_batch_size < 64
    traced = {p.batch_size: p.peak_bytes for p in phase.traced}
    assert traced[phase.max_batch_size] <= device.usable_bytes < traced[phase.max_batch_size + 1]
    lines = eval_lines(phase)
    assert "the eval step sets the run's peak" in lines[0]
    assert lines[1].startswith("eval batch 64 does not fit: the training step fits") and \
        f"per_device_eval_batch_size={phase.max_batch_size}" in lines[1]
    data = result.to_json()["eval"]
    assert data["verdict"] == "does not fit" and data["deciding_phase"] == "eval"
    assert data["max_batch_size"] == phase.max_batch_size and "## The eval loop" in eval_markdown(phase)
    assert not any("eval" in a.what for a in result.approximations)  # one shape, plain loss: nothing approximated


def test_with_data_the_eval_batches_are_the_datas_padded_the_same_way():
    """pad-longest eval batches of 3 over the data: the one holding the 60-token sample (samples 6-8,
    eval step 2) is the eval loop's worst; the training step before it is the run's worst batch."""
    lengths = [10, 12, 9, 11, 10, 12, 60, 8, 10, 9]
    device = custom_device(2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate_run(lambda n: tiny(n, vocab=512), lengths,
                              RunRequest(data="d.jsonl", batching=Batching("pad-longest")),
                              EstimateRequest(limit="allocated", batch_sizes=[2], max_batch=2, eval_batch_size=3),
                              device=device)
    phase = result.eval_phase
    assert step_shapes(lengths, Batching("pad-longest"), 3, 60)[2] == Shape(3, 60)
    assert phase.asked.peak_shape == Shape(3, 60) and phase.fits
    assert not any("eval" in a.what for a in result.approximations)  # one held step: its own shape
    assert phase.train_shape == result.run.runs[2].peak_shape == Shape(2, 60)
    with pytest.raises(OptionError, match="drop `eval_batch_size`"):
        estimate_run(lambda n: tiny(n, vocab=512), lengths, RunRequest(data="d.jsonl", batching=Batching("tokens", 64)),
                     EstimateRequest(eval_batch_size=3), device=device)


def _args(tmp_path, **fields) -> str:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, **fields)
    path = tmp_path / "args.json"
    path.write_text(args.to_json_string())
    return str(path)


def test_trainer_args_give_the_eval_batch_where_they_evaluate(tmp_path):
    from batchfit.config.trainer import merged_eval, read_trainer

    door = read_trainer(_args(tmp_path, eval_strategy="steps", per_device_eval_batch_size=16,
                              eval_accumulation_steps=2))
    mapping = door.mapping
    assert (mapping.per_device_eval_batch_size, mapping.eval_accumulation_steps) == (16, 2)
    used = {u.field: u.option for u in mapping.used}
    assert used["per_device_eval_batch_size"] == "--eval-batch-size 16"
    assert used["eval_accumulation_steps"] == "--eval-accumulation-steps 2"
    assert not {"per_device_eval_batch_size", "eval_accumulation_steps"} & {u.field for u in mapping.unused}
    assert merged_eval(None, None, door) == (16, 2)
    with pytest.raises(OptionError, match="--eval-batch-size 8 contradicts"):
        merged_eval(8, None, door)
    quiet = read_trainer(_args(tmp_path, per_device_eval_batch_size=16))  # eval_strategy "no": no eval loop
    assert quiet.mapping.per_device_eval_batch_size is None and merged_eval(None, None, quiet) == (None, 1)
    why = {u.field: u.why for u in quiet.mapping.unused}
    assert why["per_device_eval_batch_size"] == "eval_strategy no: no evaluation runs"
    assert json.loads(json.dumps(mapping.to_json()))["per_device_eval_batch_size"] == 16


@pytest.mark.slow  # 19 s here: the run's traces at up to 16 packed rows, and the eval batch bisected from 64
def test_the_answer_in_the_users_knobs_keeps_the_global_batch(tmp_path):
    """Item 4: TrainingArguments (8 x 2 accumulation = 16 per step, eval batch 64, no packing) and a run
    over 120 samples of 20-40 tokens packed to rows of 64: the emitted args keep 16 rows per step, turn
    packing on at max_length 64 (both named in the notes) and lower the eval batch to the largest that
    fits; every other field is the user's, byte for byte."""
    from batchfit.config.trainer import emitted_text, merged_batching, read_trainer, run_answer

    door = read_trainer(_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                              eval_strategy="steps", per_device_eval_batch_size=64))
    lengths = [20 + (i * 7) % 21 for i in range(120)]
    device = custom_device((512 + 64 + 40) * 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate_run(tiny, lengths, RunRequest(data="d.jsonl", batching=Batching("pack", 64)),
                              EstimateRequest(limit="allocated", max_batch=16,
                                              eval_batch_size=door.mapping.per_device_eval_batch_size),
                              device=device)
    fitted = run_answer(door, result)
    micro, steps = fitted["per_device_train_batch_size"], fitted["gradient_accumulation_steps"]
    assert micro * steps == 16 and micro <= result.run.max_batch_size
    phase = result.eval_phase
    assert 0 < phase.max_batch_size < 64
    assert fitted["fields"] == {"packing": True, "max_length": 64, "per_device_eval_batch_size": phase.max_batch_size}
    assert any(n.startswith("packing: true (--batching pack:64)") for n in fitted["notes"])
    assert f"per_device_eval_batch_size 64 -> {phase.max_batch_size}: the eval loop at 64 does not fit" in \
        " ".join(fitted["notes"])
    before, after = json.loads(door.args.text), json.loads(emitted_text(door, fitted))
    changed = {k: after[k] for k in after if before.get(k, "absent") != after[k]}
    assert changed == {"per_device_train_batch_size": micro, "gradient_accumulation_steps": steps, "packing": True,
                       "max_length": 64, "per_device_eval_batch_size": phase.max_batch_size}
    emitted = emitted_text(door, fitted).splitlines()  # edited in place: TRL's two fields added last
    assert len(emitted) == len(door.args.text.splitlines()) + 2 and emitted[-3:] == [
        '  "packing": true,', '  "max_length": 64', "}"]
    # args that pack already decide the batching; another one typed beside them is a contradiction
    packed = read_trainer(_args(tmp_path, per_device_train_batch_size=2))
    packed.mapping.packing, packed.mapping.seq_len = True, 128
    assert merged_batching(None, "d.jsonl", packed) == "pack:128"
    with pytest.raises(OptionError, match="`batching` pad-longest contradicts"):
        merged_batching("pad-longest", "d.jsonl", packed)


def test_what_the_eval_trace_approximates_is_listed_and_only_then():
    from batchfit.estimator.eval_phase import EvalPhase, EvalPoint, eval_approximations

    asked = EvalPoint(8, Shape(8, 60), 10, 12)
    phase = EvalPhase(8, 3, 4, Shape(4, 60), 9, 12, asked)
    both = eval_approximations(phase, StepOptions(loss="fused-linear"), varying=True)
    assert [a.what.split(":")[0] for a in both] == ["--eval-accumulation-steps 3",
                                                    "--eval-batch-size with --loss fused-linear"]
    assert "8 x 60 tokens" in both[0].what and all("high" in a.may_differ_by for a in both)
    assert eval_approximations(phase, StepOptions(), varying=False) == []


def test_an_eval_loop_whose_bytes_fit_but_whose_blocks_the_allocator_cannot_place(tmp_path):
    """Fragmentation, not size: a transformers Llama (2 layers, hidden 32, vocab 128) on a GPU of 600 MiB
    (88 MiB usable), bf16-mixed, a training step of 16 x 62 tokens, then eval steps of 62 x 62 holding
    two steps' logits: the eval loop allocates about 74 MB, under the 92,274,688 B usable, but the
    allocator model cannot place its next block (88 MiB reserved in segments the live tensors pin, and a
    new 20 MiB segment); with expandable segments the same stream reserves about 90 MB and fits."""
    transformers = pytest.importorskip("transformers")
    from batchfit.specs import load_workload

    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=128,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    device = custom_device(600 * 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracer = EvalTracer(load_workload(f"hf:{tmp_path}", seq_len=62), lambda n: None, Shape(16, 62),
                            StepOptions(precision="bf16-mixed"), device, held_steps=2)
        try:
            point = tracer.point(Shape(62, 62))
            train = tracer.train_peak_bytes
        finally:
            tracer.close()
    assert train < point.peak_bytes < device.usable_bytes  # its tensors fit
    assert point.peak_reserved_bytes is None and "Tried to allocate 20.00 MiB" in point.oom
    assert point.expandable_reserved_bytes <= device.usable_bytes
    assert not point.fits(device, "reserved") and point.fits(device, "allocated")
    from batchfit.estimator.eval_phase import EvalPhase

    line = eval_lines(EvalPhase(62, 2, 16, Shape(16, 62), train, None, point, max_batch_size=48))[1]
    assert "cannot place a block" in line
    assert "fragmentation; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line
