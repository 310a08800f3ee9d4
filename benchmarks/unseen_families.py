"""Families the support matrix never saw, through the issue-30 cells: estimate with bf16-mixed +
compile model + full checkpointing + chunked loss, and plan with pp2+fsdp and fsdp+tp2.

    PYTHONPATH=src python benchmarks/unseen_families.py [starcoder2,smollm3,glm,stablelm,cohere,qwen2_moe]

Each family is a transformers config class at the matrix's tiny size; each cell must trace or be refused
in one line (a crash is printed as such). Writes benchmarks/results/unseen_families-<date>.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import support_matrix as matrix  # noqa: E402
from _common import write_result  # noqa: E402

_T = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          vocab_size=256, max_position_embeddings=256)
UNSEEN = {
    "starcoder2": dict(model_type="starcoder2", **_T),
    "smollm3": dict(model_type="smollm3", pad_token_id=0, **_T),
    "glm": dict(model_type="glm", head_dim=16, pad_token_id=0, eos_token_id=1, **_T),
    "stablelm": dict(model_type="stablelm", **_T),
    "cohere": dict(model_type="cohere", pad_token_id=0, bos_token_id=1, eos_token_id=2, **_T),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, **_T),
}
CELLS = [dict(precision="bf16-mixed", compile="model", checkpointing="full", loss="chunked:4"),
         dict(strategy="pp2+fsdp"), dict(strategy="fsdp+tp2")]


def main() -> None:
    families = sys.argv[1].split(",") if len(sys.argv) > 1 else list(UNSEEN)
    matrix.FAMILIES.update(UNSEEN)  # this process only: the tests never see them
    folder = Path(tempfile.mkdtemp())
    outcomes = []
    for family in families:
        for cell in CELLS:
            row = {**matrix.DEFAULTS, "family": family, **cell}
            outcome = matrix.run_row(row, folder, "allocated")
            print(f"{matrix.row_id(row):45s} {outcome.status:8s} {outcome.seconds:6.1f} s  {outcome.detail[:160]}",
                  flush=True)
            outcomes.append(outcome.to_json())
    write_result("unseen_families", {"outcomes": outcomes})


if __name__ == "__main__":
    main()
