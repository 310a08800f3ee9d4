"""Formula priors for the batch size and learning rate: free, and never measurements.

Step Law (Li et al. 2025, "Predictable Scale: Part I -- Optimal Hyperparameter Scaling Law in
Large Language Model Pretraining", arXiv:2503.04715), fitted by a grid search over 3,700
dense and MoE LLMs trained with AdamW:

    lr_opt(N, D) = 1.79 * N^-0.713 * D^0.307
    B_opt(D)     = 0.58 * D^0.571          (in tokens; / sequence length for sequences)

with N the non-embedding parameters and D the training tokens. The constants are the ones the
paper publishes (and that public re-implementations use, e.g. the "stepfun" baseline that
divides B by its 2048-token sequences). The range of model sizes the fit covers could not be
looked up from this machine; the paper's published test points are 400M parameters on 40B
tokens and 1B parameters on 100B tokens (step-law.github.io, figure 1), so a model far below
400M is flagged as an extrapolation.

Power Lines (Bergsma et al. 2025, "Power Lines: Scaling Laws for Weight Decay and Batch Size in
LLM Pre-training", arXiv:2505.13738): B_opt and B_crit are power laws in D alone, independent
of N. Its fitted coefficients and exponents could not be found from this machine, so batchfit
shows the law's form and no number rather than inventing one. Looked for (2026-11-25): the
stored arXiv pages (2505.13738v1 and v2: their opening, abstract and figure 1 caption only, not
the fit), public paper-note repositories and reading lists (titles and links only), issue
threads on critical batch size (marin-community/marin, karpathy/nanochat: no constants), and
documentation pages (none).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STEP_LAW = {"lr_coefficient": 1.79, "lr_n_exponent": -0.713, "lr_d_exponent": 0.307,
            "batch_coefficient": 0.58, "batch_d_exponent": 0.571}
STEP_LAW_TEST_POINTS = ((400e6, 40e9), (1e9, 100e9))
"""(parameters, tokens) where the paper tested the law against a grid search."""


@dataclass(kw_only=True)
class Prior:
    """One formula's answer, shown beside the measurements, never mixed into them."""

    source: str
    """The paper and its equation."""
    batch_size: float | None
    """In samples (sequences); None when the formula gives no number here."""
    batch_tokens: float | None = None
    lr: float | None = None
    fitted_on: str = ""
    """The model sizes the constants were fitted on."""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def step_law(params: int, tokens: int, seq_len: int | None) -> Prior:
    """Step Law's batch size and learning rate for ``params`` parameters trained on ``tokens``."""
    c = STEP_LAW
    batch_tokens = c["batch_coefficient"] * tokens ** c["batch_d_exponent"]
    lr = c["lr_coefficient"] * params ** c["lr_n_exponent"] * tokens ** c["lr_d_exponent"]
    notes = ["a prior from a formula (computed), not a measurement of this model"]
    low = min(n for n, _ in STEP_LAW_TEST_POINTS)
    if params < low / 10:
        notes.append(f"{params:,} parameters is far below the law's published test points (400M and 1B "
                     "parameters): an extrapolation")
    return Prior(source="Step Law (Li et al. 2025): B = 0.58 D^0.571 tokens, lr = 1.79 N^-0.713 D^0.307",
                 batch_size=batch_tokens / seq_len if seq_len else None, batch_tokens=batch_tokens, lr=lr,
                 fitted_on="fitted range not found here; tested at 400M params / 40B tokens and 1B / 100B",
                 notes=notes)


def power_lines(tokens: int) -> Prior:
    """Power Lines' form, without its constants (not found: see the module docstring)."""
    return Prior(source="Power Lines (Bergsma et al. 2025): B_opt = c D^m (a power law in tokens, independent of N)",
                 batch_size=None, fitted_on="not found here",
                 notes=["the paper's fitted c and m could not be looked up from this machine: no number is shown "
                        "rather than an invented one"])


def priors(params: int, tokens: int | None, seq_len: int | None) -> list[Prior]:
    """Every prior that applies: both need a budget in tokens."""
    if tokens is None:
        return []
    return [step_law(params, tokens, seq_len), power_lines(tokens)]
