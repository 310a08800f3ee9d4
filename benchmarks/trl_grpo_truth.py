"""batchfit's GRPO step against TRL's own: a REAL ``trl.GRPOTrainer`` step on this CPU, each phase's peak
from the torch profiler's memory timeline, beside the trace of the same GRPOConfig (``--trainer``'s mapping,
``cuda_semantics=False``), per phase (``tests/trl_truth.py`` runs both). Needs ``pip install trl``.

Three GRPOConfigs on a 2-layer Llama (hidden 32, vocabulary 256), fp32, AdamW, 8-token prompts, 6-token
completions, 4 completions per update: a reference model (beta 0.04); two update steps per generation (TRL
then computes the policy's old log-probs too); no reference model (beta 0). Then the first with bf16 weights,
alone and with five sampling fields away from their defaults (five logits processors more: ``BF16_CASES``). Every
real step runs on one thread with oneDNN off (``cpu_truth.same_kernels_on_any_x86``). Also written: the trace for a
GPU (``cuda_semantics=True``: TRL's Triton fold, completion tokens only, 512-byte blocks), no truth beside it.
Writes benchmarks/results/trl_grpo_truth-<date>.json.

    python benchmarks/trl_grpo_truth.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import write_result  # noqa: E402
from cpu_truth import same_kernels_on_any_x86  # noqa: E402
from trl_truth import BF16_CASES, CASES, PHASES, case_json, tiny_llama, traced_phase_peaks, trl_phase_peaks  # noqa: E402


def main() -> None:
    import trl

    rows, cases = [], []
    for case in CASES + BF16_CASES:
        with tempfile.TemporaryDirectory() as folder:
            model = tiny_llama(Path(folder))
            started = time.perf_counter()
            with same_kernels_on_any_x86():
                real = trl_phase_peaks(case, model)
            seconds = time.perf_counter() - started
            traced = traced_phase_peaks(case, model)
            gpu = traced_phase_peaks(case, model, cuda_semantics=True)
        print(f"{case.label} (TRL step and its setup: {seconds:.0f} s)")
        print(f"  {'phase':<10} {'traced B':>12} {'TRL B':>12} {'error':>9}")
        for phase in PHASES:
            if phase not in real:
                continue
            error = (traced[phase] - real[phase]) / real[phase]
            rows.append({"label": f"{case.label}: {phase}", "traced_bytes": traced[phase],
                         "cpu_truth_bytes": real[phase], "error": error})
            print(f"  {phase:<10} {traced[phase]:>12,} {real[phase]:>12,} {error:>+9.3%}", flush=True)
        cases.append({**case_json(case), "traced_for_a_gpu_bytes": {p: gpu[p] for p in PHASES if p in gpu}})
    path = write_result("trl_grpo_truth", {
        "trl": trl.__version__, "model": "LlamaForCausalLM, 2 layers, hidden 32, vocabulary 256",
        "precision": "fp32; bf16 weights where a case's dtype says so",
        "truth": "torch.profiler export_memory_timeline of a real trl.GRPOTrainer step (the second that generates), "
                 "each phase from the total live as it begins to its end",
        "traced": "TraceSession(hf_grpo_workload(from_training_arguments(GRPOConfig json).rollout), its step options, "
                  "cuda_semantics=False) at the same per-device batch",
        "cases": cases, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
