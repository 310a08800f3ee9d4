"""The support matrix: model families x the options that change memory x the strategies.

Each family is one line: a transformers config class at a tiny size (built with no weights, as
``hf:config.json`` builds any model). Each dimension lists the values a user can type. A *row*
is one command a user could run (``estimate`` for one GPU, ``plan`` for a strategy), and it must
either trace, or be refused before any tracing with one line (a :class:`UsageError`); a
:class:`TraceError` or any other exception is a crash, a failing test.

``pairwise_rows()`` (the fast tier) and ``slow_rows()`` (the slow tier) are covering arrays, built
greedily and deterministically, that together hold every pair of values of any two dimensions;
``default_rows()`` is each family at its defaults with reserved memory replayed. Pairs that are
refused by design (``REFUSED``: what batchfit does not support, with the line it says) are left out
of the arrays and checked on their own, so a refusal never hides the pairs its row was meant to cover.

A new family is one line in ``FAMILIES``.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", **_TINY),
    "qwen2": dict(model_type="qwen2", **_TINY),
    "qwen3": dict(model_type="qwen3", head_dim=16, **_TINY),
    "mistral": dict(model_type="mistral", **_TINY),
    "gemma2": dict(model_type="gemma2", head_dim=16, **_TINY),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, **_TINY),
    "phi3": dict(model_type="phi3", pad_token_id=0, **_TINY),
    "gpt_neox": dict(model_type="gpt_neox", **{k: v for k, v in _TINY.items() if k != "num_key_value_heads"}),
    "olmo2": dict(model_type="olmo2", **_TINY),
    "granite": dict(model_type="granite", **_TINY),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=256, bos_token_id=0,
                 eos_token_id=0),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **_TINY),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, head_dim=16, **_MOE, **_TINY),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        **_MOE, **{**_TINY, "num_key_value_heads": 4}),
    "bert": dict(model_type="bert", architectures=["BertForMaskedLM"],
                 **{k: v for k, v in _TINY.items() if k != "num_key_value_heads"}),
    "t5": dict(model_type="t5", d_model=64, d_ff=128, num_layers=4, num_heads=4, d_kv=16, vocab_size=256,
               decoder_start_token_id=0),
}
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")
NOT_CAUSAL = ("bert", "t5")
SEQ_LEN = 128  # cp2 under the memory-efficient kernel needs 64 x cp (trace/cuda_attention.py)
BATCH = 2

# One value per dimension is the default a user gets without the flag (listed first).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "family": tuple(FAMILIES),
    "precision": ("fp32", "bf16-mixed", "bf16", "fp8-rowwise"),
    "checkpointing": ("none", "full", "selective", "every:2"),
    "compile": ("none", "model", "blocks"),
    "loss": ("plain", "chunked:4", "fused-linear"),
    "recipe": ("none", "offload", "qlora", "adamw-8bit", "muon"),
    "strategy": ("single", "ddp", "fsdp", "hsdp2", "zero1", "zero2", "tp2", "fsdp+tp2", "pp2+fsdp",
                 "pp2/gpipe", "pp2+fsdp-noreshard/zbv", "fsdp+cp2", "ep2+fsdp"),
}
GPUS = {"hsdp2": 4, "fsdp+tp2": 4, "pp2+fsdp": 4, "pp2+fsdp-noreshard/zbv": 4, "fsdp+cp2": 4, "ep2+fsdp": 4}
"""GPUs a strategy is planned on (2 where not listed)."""
DTENSORS = ("fsdp", "hsdp2", "tp2", "fsdp+tp2", "pp2+fsdp", "pp2+fsdp-noreshard/zbv", "fsdp+cp2", "ep2+fsdp")
"""The strategies whose parameters are DTensors (FSDP2, TP, ep)."""
RECIPES: dict[str, dict] = {
    "none": {}, "offload": dict(offload="activations"), "qlora": dict(quantize="nf4", lora="r=8"),
    "adamw-8bit": dict(optimizer="adamw-8bit"), "muon": dict(optimizer="muon"),
}


# What batchfit refuses by design: (an example, a predicate on a row's values, what it is). An entry of
# two dimensions leaves that pair out of the arrays; one of three (GPT-2, float8, TP) leaves out rows
# holding all three, and each of its pairs is still covered by other rows.
REFUSED: list[tuple[dict, object, str]] = [
    (dict(family="llama", strategy="ep2+fsdp"), lambda r: r["strategy"] == "ep2+fsdp" and r["family"] not in MOE,
     "expert parallelism needs an MoE model"),
    (dict(family="bert", loss="chunked:4"), lambda r: r["loss"] != "plain" and r["family"] in NOT_CAUSAL,
     "chunked and fused-linear losses are next-token losses of a causal LM"),
    (dict(precision="fp8-rowwise", recipe="qlora"),
     lambda r: r["recipe"] == "qlora" and r["precision"] == "fp8-rowwise",
     "float8 linears and bitsandbytes linears are two kinds of the same layer"),
    (dict(recipe="qlora", strategy="ddp"), lambda r: r["recipe"] == "qlora" and r["strategy"] != "single",
     "QLoRA (--quantize) is traced on one GPU only, not under plan's strategies yet"),
    (dict(recipe="adamw-8bit", strategy="fsdp"), lambda r: r["recipe"] == "adamw-8bit" and r["strategy"] in DTENSORS,
     "bitsandbytes' 8-bit optimizers step plain tensors, not DTensor shards (FSDP2, TP, ep)"),
    (dict(loss="chunked:4", strategy="pp2+fsdp"), lambda r: r["loss"] != "plain" and r["strategy"].startswith("pp"),
     "chunked and fused-linear losses are not traced under pipeline parallelism yet"),
    (dict(loss="fused-linear", strategy="tp2"), lambda r: r["loss"] != "plain" and "tp" in r["strategy"],
     "chunked and fused-linear losses take a whole head, not a vocabulary-sharded one (TP's loss is loss_parallel)"),
    (dict(family="bert", strategy="fsdp+cp2"), lambda r: r["family"] in NOT_CAUSAL and "cp" in r["strategy"],
     "context parallelism's ring attention is causal only"),
    (dict(family="gemma2", strategy="fsdp+cp2"), lambda r: r["family"] == "gemma2" and "cp" in r["strategy"],
     "context parallelism replaces SDPA, and Gemma 2 runs eager attention (SDPA unsupported by its class)"),
    (dict(family="gemma2", loss="chunked:4"), lambda r: r["family"] == "gemma2" and r["loss"] != "plain",
     "Gemma 2's head softcaps its logits: not hidden @ weight.T, which chunked and fused losses compute"),
    (dict(family="mixtral", strategy="tp2"), lambda r: r["family"] in MOE and "tp" in r["strategy"],
     "an MoE's experts are tensor-parallel only beside expert parallelism (ep<N>+fsdp+tp<M>)"),
    (dict(family="t5", strategy="tp2"), lambda r: r["family"] == "t5" and "tp" in r["strategy"],
     "T5 has no tensor-parallel plan (no base_model_tp_plan)"),
    (dict(recipe="offload", strategy="tp2"), lambda r: r["recipe"] == "offload" and ("tp" in r["strategy"]
                                                                                      or "cp" in r["strategy"]),
     "activation offloading copies saved tensors into plain host tensors; TP and cp save DTensors"),
    (dict(checkpointing="selective", strategy="pp2+fsdp-noreshard/zbv"), lambda r: r["checkpointing"] == "selective"
     and r["strategy"].endswith("zbv"),
     "selective checkpointing lets a region backward once; zero-bubble runs it twice"),
    (dict(family="gpt2", strategy="pp2+fsdp"), lambda r: r["family"] == "gpt2" and r["strategy"].startswith("pp"),
     "GPT-2's config has no base_model_pp_plan"),
    (dict(family="gpt2", precision="fp8-rowwise", strategy="tp2"), lambda r: r["family"] == "gpt2"
     and r["precision"] == "fp8-rowwise" and "tp" in r["strategy"],
     "float8 on GPT-2 under TP: its Conv1D layers become linears inside the TP plan, after float8's conversion"),
    (dict(family="gpt2", recipe="qlora"), lambda r: r["family"] == "gpt2" and r["recipe"] == "qlora",
     "GPT-2's layers are Conv1D, not the nn.Linear layers bitsandbytes quantizes"),
    (dict(family="bert", strategy="pp2+fsdp"), lambda r: r["family"] in NOT_CAUSAL and r["strategy"].startswith("pp"),
     "pipeline plans cut causal LMs by their base_model_pp_plan"),
]


def refusal(row: dict) -> str | None:
    """Why batchfit refuses this row by design, or None."""
    for example, refused, why in REFUSED:
        if all(d in row for d in example) and refused(row):
            return why
    return None


def _allowed_pair(a: tuple[str, str], b: tuple[str, str]) -> bool:
    return refusal(dict([a, b])) is None


def cost(row: dict) -> float:
    """A row's rough cost in units of a plain tiny trace, so the array prefers cheap rows where they
    cover the same pairs: compiling costs several, float8 under compile (inductor over torchao's
    subclasses) many more."""
    compiled = row.get("compile", "none") != "none"
    return 4 * compiled + 12 * (compiled and row.get("precision") == "fp8-rowwise")


def covering_rows(dimensions: dict[str, tuple[str, ...]], wanted=lambda a, b: True, seed: int = 0,
                  candidates: int = 30, allowed=lambda row: True) -> list[dict]:
    """Rows over ``dimensions`` that hold every allowed pair of values of two dimensions that
    ``wanted(a, b)`` asks for (a greedy covering array, deterministic for a seed), each row one that
    ``allowed(row)`` takes (asked of partial rows too)."""
    dims = list(dimensions)
    uncovered = {((d1, v1), (d2, v2))
                 for d1, d2 in itertools.combinations(dims, 2)
                 for v1 in dimensions[d1] for v2 in dimensions[d2]
                 if _allowed_pair((d1, v1), (d2, v2)) and wanted((d1, v1), (d2, v2))}
    rng = random.Random(seed)
    rows: list[dict] = []
    while uncovered:
        first = min(uncovered)  # deterministic: the first uncovered pair seeds each candidate
        best, best_gain = None, float("-inf")
        for _ in range(candidates):
            row = dict(first)
            for dim in rng.sample(dims, len(dims)):
                if dim in row:
                    continue
                options = [v for v in dimensions[dim] if refusal({**row, dim: v}) is None and allowed({**row, dim: v})]
                rng.shuffle(options)
                row[dim] = max(options, key=lambda v: (sum(
                    tuple(sorted(((dim, v), (d, row[d])), key=lambda p: dims.index(p[0]))) in uncovered
                    for d in row), -cost({**row, dim: v})))
            gain = sum(pair in uncovered for pair in _pairs(row, dims)) - cost(row) / 4
            if gain > best_gain:
                best, best_gain = row, gain
        uncovered -= set(_pairs(best, dims))
        rows.append({d: best[d] for d in dims})
    return rows


FAST = {**DIMENSIONS, "compile": ("none",), "precision": ("fp32", "bf16-mixed", "bf16")}
"""The fast tier's values: no compile (a compiled tiny trace runs inductor's own partition and code,
10-40 s on a 2-core machine) and no float8 (torchao's subclasses: 40% of the array's time)."""


def _fast_pair(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """A pair the fast tier holds: both values in :data:`FAST`, and not a family with a strategy (16 x 13
    pairs, which alone would need 200 rows)."""
    return (all(v in FAST[d] for d, v in (a, b))) and {a[0], b[0]} != {"family", "strategy"}


@functools.cache
def pairwise_rows() -> list[dict]:
    """The fast tier's rows: every allowed pair :func:`_fast_pair` takes (~90 rows). Made once per process."""
    return covering_rows(FAST, wanted=_fast_pair)


COSTLY = (("compile", "model"), ("compile", "blocks"), ("precision", "fp8-rowwise"))
"""The values that make a tiny trace several times dearer: inductor's compile, torchao's float8 subclasses."""
WRAPS = tuple(("strategy", s) for s in ("single", "ddp", "fsdp", "hsdp2", "zero1", "zero2"))
"""The strategies that wrap the model whole or block by block, without a plan of its code (TP, pipeline cuts,
cp's ring, ep's experts): each family meets single and fsdp at its defaults in CI (:func:`default_rows`)."""
COSTLY_FAMILIES = ("llama", "gemma2", "mixtral", "deepseek_v3", "gpt2", "t5")
"""The families CI's slow tier pairs with :data:`COSTLY` values and :data:`WRAPS`: one of each kind of model
(GQA decoder, softcapped eager attention, MoE, MLA + MoE, tied Conv1D GPT-2, encoder-decoder), as the support
truths' ``IN_CI`` (granite's scaled logits are extended since 2026-11-29: CI's 30 minutes). Every other
family meets those in :func:`extended_rows` (``pytest -m extended``), and every other value in CI: the fast
tier's array, and the slow tier's with the strategies that plan its code."""


def _costly(row: dict) -> bool:
    return any(row.get(dim) == value for dim, value in COSTLY + WRAPS)


def _extended_pair(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """A family beyond :data:`COSTLY_FAMILIES` with a :data:`COSTLY` value or one of the :data:`WRAPS`."""
    family = next((v for d, v in (a, b) if d == "family"), None)
    return family is not None and family not in COSTLY_FAMILIES and any(p in COSTLY + WRAPS for p in (a, b))


def _in_ci(row: dict) -> bool:
    return row.get("family") in (None, *COSTLY_FAMILIES) or not _costly(row)


@functools.cache
def slow_rows() -> list[dict]:
    """The slow tier's rows: every other allowed pair (each family with each strategy; compile and float8
    with every value) but :func:`extended_rows`', no row pairing a costly value or a plain wrap with a family
    beyond one of each kind."""
    return covering_rows(DIMENSIONS, wanted=lambda a, b: not _fast_pair(a, b) and not _extended_pair(a, b),
                         allowed=_in_ci)


@functools.cache
def extended_rows() -> list[dict]:
    """Each family beyond :data:`COSTLY_FAMILIES` with each costly value and plain wrap (``pytest -m extended``)."""
    return covering_rows(DIMENSIONS, wanted=_extended_pair)


def all_pairs_covered() -> set:
    """Every allowed pair the three arrays hold together."""
    dims = list(DIMENSIONS)
    return {pair for row in pairwise_rows() + slow_rows() + extended_rows() for pair in _pairs(row, dims)}


def _pairs(row: dict, dims: list[str]):
    for d1, d2 in itertools.combinations(dims, 2):
        yield (d1, row[d1]), (d2, row[d2])


DEFAULTS = {dim: values[0] for dim, values in DIMENSIONS.items()}


def default_rows() -> list[dict]:
    """Every family as a user runs it first (every option at its default), on one GPU and under fsdp,
    with reserved memory replayed through the allocator model (the arrays check ``--limit allocated``)."""
    return [{**DEFAULTS, "family": family, "strategy": strategy}
            for family in FAMILIES for strategy in ("single", "fsdp")]


def row_id(row: dict) -> str:
    return "-".join(f"{row[d]}" for d in DIMENSIONS if row[d] != DEFAULTS[d] or d == "family")


@dataclass
class Outcome:
    """What one row did: traced, refused (one line) or crashed (anything else)."""

    row: dict
    status: str
    detail: str = ""
    seconds: float = 0.0

    limit: str = "reserved"

    def to_json(self) -> dict:
        return {"row": self.row, "status": self.status, "detail": self.detail, "seconds": round(self.seconds, 2),
                "limit": self.limit}


def config_file(family: str, folder: Path) -> Path:
    path = folder / f"{family}.json"
    if not path.exists():
        path.write_text(json.dumps(FAMILIES[family]))
    return path


def options_of(row: dict) -> dict:
    return dict(precision=row["precision"], checkpointing=row["checkpointing"], compile=row["compile"],
                loss=row["loss"], **RECIPES[row["recipe"]])


def run_row(row: dict, folder: Path, limit: str = "reserved") -> Outcome:
    """Run ``row`` as a user would, through the public API, and say what happened. ``limit``:
    --limit (the fast tier's array checks the traces with ``allocated``, which skips the replay
    of each allocation stream through the allocator model; the slow tier's rows replay it)."""
    from batchfit import StepOptions, get_device, load_workload
    from batchfit.errors import TraceError, UsageError
    from batchfit.estimator.engine import estimate
    from batchfit.plan.engine import plan
    from batchfit.plan.world import World

    started = time.perf_counter()
    strategy = row["strategy"]
    try:
        options = StepOptions(**options_of(row))
        workload = load_workload(f"hf:{config_file(row['family'], folder)}", seq_len=SEQ_LEN,
                                 for_plan=strategy != "single")
        device = get_device("a100-80gb")
        if strategy == "single":
            estimate(workload, device=device, options=options, batch_sizes=[BATCH], max_batch=BATCH, suggest=False,
                     limit=limit)
        else:
            name, _, schedule = strategy.partition("/")
            plan(workload, device=device, worlds=[World(GPUS.get(strategy, 2))], options=options, strategies=name,
                 batch_sizes=[BATCH], max_batch=BATCH, processes=1, pp_schedule=schedule or "1f1b", limit=limit)
    except UsageError as error:
        return Outcome(row, "refused", str(error), time.perf_counter() - started, limit)
    except TraceError as error:
        return Outcome(row, "crash", f"TraceError: {error}", time.perf_counter() - started, limit)
    except Exception as error:  # the crash the matrix exists to find
        first = (str(error).splitlines() or [""])[0]
        return Outcome(row, "crash", f"{type(error).__name__}: {first}", time.perf_counter() - started, limit)
    return Outcome(row, "traced", "", time.perf_counter() - started, limit)


def check(row: dict, folder: Path, limit: str = "reserved") -> Outcome:
    """Run ``row``; keep its outcome where ``BATCHFIT_SUPPORT_RESULTS`` names a file; fail on a crash
    or on a refusal that is not one line."""
    import os

    outcome = run_row(row, folder, limit)
    results = os.environ.get("BATCHFIT_SUPPORT_RESULTS")
    if results:
        with open(results, "a") as file:
            file.write(json.dumps(outcome.to_json()) + "\n")
    assert outcome.status != "crash", f"{row_id(row)}: {outcome.detail}"
    if outcome.status == "refused":  # one line, that says what to use instead
        assert "\n" not in outcome.detail and ":" in outcome.detail, outcome.detail
    return outcome


def half(rows: list[dict], which: int) -> list[dict]:
    """Every other row (``which`` 0 or 1): the matrix runs as two test files, one per xdist worker
    (``--dist loadfile`` keeps a file on one worker)."""
    return rows[which::2]
