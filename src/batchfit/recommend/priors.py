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

Power Lines (Bergsma, Dey, Gosal, Gray, Soboleva, Hestness 2025, "Power Lines: Scaling Laws for
Weight Decay and Batch Size in LLM Pre-training", arXiv:2505.13738), fitted on GPT-2-like models of
111M to 3.3B parameters at 20 to 1280 tokens per parameter (AdamW, muP, one epoch of SlimPajama,
linear decay to zero, 2048-token sequences):

    B_opt(D)   = 0.0306 * D^0.383      (in 2048-token sequences; R^2 0.984, exponent 0.367-0.391)
    tau_opt    = 1.084 * TPP^-0.527    (TPP = D/N; tau = B / (lr * weight_decay * D), R^2 0.975)

B_opt and B_crit depend on D alone, not on N. B_crit grows as D^0.47 in the paper; its level
depends on the overhead that defines it, so no B_crit number is shown. The paper's own fit table
could not be opened from this machine (the stored arXiv pages hold the abstract and figure 1's
caption only); the constants are the ones public code quotes from it, and they check against each
other: a training script's --global-batch-size help quotes "B_opt = 0.0306*D^0.383 (B in
2048-token sequences), giving 0.721M tokens at D=40e9" (0.0306 x (40e9)^0.383 x 2048 = 0.7206M:
tests/test_recommend.py checks it), two independent paper notes give tau_opt = 1.084 TPP^-0.527 and the exponent's
range, and karpathy/nanochat's base_train.py scales its batch by the same D^0.383.
The weight decay is the one Power Lines' timescale asks for at the batch and rate batchfit
recommends: weight_decay = B / (lr * tau_opt * D), with B and D in the same unit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STEP_LAW = {"lr_coefficient": 1.79, "lr_n_exponent": -0.713, "lr_d_exponent": 0.307,
            "batch_coefficient": 0.58, "batch_d_exponent": 0.571}
STEP_LAW_TEST_POINTS = ((400e6, 40e9), (1e9, 100e9))
"""(parameters, tokens) where the paper tested the law against a grid search."""
POWER_LINES = {"batch_coefficient": 0.0306, "batch_d_exponent": 0.383, "batch_seq_len": 2048,
               "tau_coefficient": 1.084, "tau_tpp_exponent": -0.527}
POWER_LINES_FIT = {"params": (111e6, 3.3e9), "tokens_per_param": (20, 1280)}
"""The model sizes and tokens per parameter the constants were fitted on."""


@dataclass(kw_only=True)
class Prior:
    """One formula's answer, shown beside the measurements, never mixed into them."""

    source: str
    """The paper and its equation."""
    batch_size: float | None
    """In samples (sequences); None when the formula gives no number here."""
    batch_tokens: float | None = None
    lr: float | None = None
    weight_decay: float | None = None
    """AdamW's weight decay the formula asks for (Power Lines' timescale), where it gives one."""
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


def power_lines(params: int, tokens: int, seq_len: int | None, *, batch_size: int | None = None,
                lr: float | None = None) -> Prior:
    """Power Lines' optimal batch for ``tokens``, and the weight decay its timescale law asks for
    at ``batch_size`` samples and rate ``lr`` (the recommendation), for ``params`` parameters."""
    c = POWER_LINES
    batch_tokens = c["batch_coefficient"] * tokens ** c["batch_d_exponent"] * c["batch_seq_len"]
    tpp = tokens / params
    tau = c["tau_coefficient"] * tpp ** c["tau_tpp_exponent"]
    weight_decay = None
    if batch_size and lr and seq_len:
        weight_decay = batch_size / (lr * tau * (tokens / seq_len))  # B and D both in samples
    notes = ["a prior from a formula (computed), not a measurement of this model",
             f"{tpp:,.1f} tokens per parameter: optimal AdamW timescale tau = {tau:.3g} of the run"]
    if weight_decay is not None:
        notes.append(f"weight decay {weight_decay:.3g} = B / (lr tau D) at the recommended batch {batch_size} and "
                     f"rate {lr:.3g}")
    low, high = POWER_LINES_FIT["params"]
    if not low <= params <= high:
        notes.append(f"{params:,} parameters is outside the fitted 111M-3.3B: an extrapolation")
    t_low, t_high = POWER_LINES_FIT["tokens_per_param"]
    if not t_low <= tpp <= t_high:
        notes.append(f"{tpp:,.1f} tokens per parameter is outside the fitted 20-1280: an extrapolation")
    return Prior(source="Power Lines (Bergsma et al. 2025): B = 0.0306 D^0.383 x 2048 tokens, tau = 1.084 TPP^-0.527",
                 batch_size=batch_tokens / seq_len if seq_len else None, batch_tokens=batch_tokens,
                 weight_decay=weight_decay, fitted_on="111M-3.3B parameters, 20-1280 tokens per parameter",
                 notes=notes)


def priors(params: int, tokens: int | None, seq_len: int | None, *, non_embedding_params: int | None = None,
           batch_size: int | None = None, lr: float | None = None) -> list[Prior]:
    """Every prior that applies: both need a budget in tokens. Step Law counts N without the
    embeddings (its definition); Power Lines' tokens per parameter count every parameter."""
    if tokens is None:
        return []
    step_n = non_embedding_params if non_embedding_params else params
    return [step_law(step_n, tokens, seq_len),
            power_lines(params, tokens, seq_len, batch_size=batch_size, lr=lr)]
