"""``plan --strategies auto``: the most tokens/s a candidate could reach, known before it is traced.

The plan's time model (``plan/time_model.py``) writes a step of one micro-batch as

    step >= compute / (1 - f) + tensor-parallel collectives,   compute = FLOPs of the busiest rank / (peak x MFU)

(FSDP's overlap, offload copies and the rest only add to it; ``f`` the pipeline schedule's idle share,
``pp_schedules.bubble_fraction``, 0 without pp; TP's collectives are never overlapped), and
tokens/s = dp x micro-batch x sequence / step. Both terms have floors per token:

- **FLOPs.** Every ``nn.Linear`` of a trained dense transformer runs once per token forward (2 FLOPs
  per weight), once for its weight's gradient and once for its input's (2 each), and under
  ``checkpointing`` full each block's linears run their forward again in the backward (2 more):
  torch's flop counter counts exactly those matmuls; attention only adds to them. Once a candidate
  without pp is traced, its FLOPs per token (rank 0's x the ranks that split a sample, over its
  tokens) are the floor instead, where higher, for every candidate of the same cp degree: data
  parallelism and TP split the same matmuls and attention evenly over their ranks without adding or
  removing any, and pp's busiest rank runs at least the mean; cp's ring attention counts other blocks
  at each degree (hf:llama-3.1-70b at seq 8192: 613.0 GFLOP a token without cp, 588.8 under any cp2,
  576.7 cp4, 570.7 cp8, whatever the tp).
- **TP's collectives.** Each block's attention and MLP end in a row-wise linear whose partial sums
  are reduced over the tp ranks (an all-reduce, or a reduce-scatter after an all-gather under
  sequence parallelism: 2 (n-1)/n of the residual stream's bytes either way, 2 bytes an element at
  least), and in the backward their inputs' gradients are, once per pass: forward, backward and the
  recomputation under ``checkpointing`` full. This floor is used only once a traced TP candidate's
  collectives have held it (the model's own TP plan could shard less).

So, whatever the micro-batch and whatever fits,

    tokens/s <= dp x sequence / (sequence x FLOPs per token / (pp x cp x tp) / (peak x MFU) / (1 - f)
                                 + sequence / cp x TP bytes per token / the fastest link)

A candidate whose bound is below the best traced candidate's tokens/s cannot be ranked first: auto
shows it as not traced, with its bound and the formula. The floors are taken only where each FLOP and
byte of them is certain (every parameter trained: no frozen, LoRA or quantized base; no mixture of
experts, whose experts see a share of the tokens; no float8 linears; a model with transformer blocks
and tokens), and each traced row is checked against them (:meth:`Evidence.learn`): a row below one
stops the setting aside, and what was set aside is traced after all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfit.plan.world import World

TP_SUBLAYERS = 2
"""Row-wise linears whose partial sums TP reduces in each block: attention's output and the MLP's."""
MIN_ACTIVATION_BYTES = 2
"""The residual stream's element, at least (bf16; fp32 is 4; float8 linears are not bounded)."""


@dataclass(frozen=True)
class LinearFlops:
    """A model's linear layers and blocks, as the floors count them."""

    linear_params: int
    """Weights of every ``nn.Linear`` (each module once)."""
    recomputed_params: int
    """Of those, the weights inside the checkpointed blocks (``checkpointing`` full; 0 otherwise)."""
    tokens_per_sample: int
    blocks: int = 0
    """Transformer blocks (TP reduces in each)."""
    hidden: int = 0
    """The residual stream's width."""

    @property
    def flops_per_token(self) -> int:
        """6 per linear weight (forward, weight gradient, input gradient), 2 more per recomputed one."""
        return 6 * self.linear_params + 2 * self.recomputed_params

    def rank_flops(self, strategy, local_batch: int) -> float:
        """The least FLOPs the busiest rank of ``strategy`` runs at ``local_batch`` samples, by the linear floor."""
        return self.flops_per_token * self.tokens_per_sample * local_batch / _split(strategy)[0]

    def tp_bytes_per_token(self, tp: int) -> float:
        """TP's least bytes a rank sends per token of its sequence (the module docstring)."""
        passes = 3 if self.recomputed_params else 2
        return self.blocks * passes * TP_SUBLAYERS * 2 * (tp - 1) / tp * self.hidden * MIN_ACTIVATION_BYTES

    def formula(self) -> str:
        recomputed = (f" + 2 x {_count(self.recomputed_params)} recomputed (checkpointing full)"
                      if self.recomputed_params else "")
        return f"{_flops(self.flops_per_token)} per token = 6 x {_count(self.linear_params)} linear weights{recomputed}"


def _count(n: float) -> str:
    """A count as people write it: 68.45B, or whole below ten million."""
    return f"{n / 1e9:,.2f}B" if n >= 10**7 else f"{n:,.0f}"


def _flops(n: float) -> str:
    return f"{n / 1e9:,.1f} GFLOP" if n >= 1e9 else f"{n:,.0f} FLOP"


def linear_flops(workload, options, experts: int | None = None) -> LinearFlops | None:
    """``workload``'s linear floor, or None where it would not be certain (the module docstring)."""
    from batchfit.options import FP8_PRECISIONS

    tokens = workload.tokens_per_sample
    if (not tokens or experts or options.frozen or options.trainable or options.lora != "none"
            or options.quantize != "none" or options.precision in FP8_PRECISIONS):
        return None
    import torch
    from torch import nn

    from batchfit.distributed.pipeline import _zoo_blocks, hidden_size_of
    from batchfit.distributed.pipeline_hf import hf_layers

    try:
        with torch.device("meta"):
            model = workload.build_model()
        blocks = _zoo_blocks(model)
        blocks = blocks if blocks is not None else hf_layers(model)
        hidden = hidden_size_of(model) if blocks is not None else 0
    except Exception:  # noqa: BLE001 - a model that needs real memory to build: the tracer decides
        return None
    if blocks is None or not all(p.requires_grad for p in model.parameters()):
        return None

    def linear(module: nn.Module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))

    recomputed = linear(blocks) if options.checkpointing_spec.kind == "full" else 0
    return LinearFlops(linear_params=linear(model), recomputed_params=recomputed, tokens_per_sample=tokens,
                       blocks=len(blocks), hidden=int(hidden))


def bubble(strategy) -> float:
    """The pipeline's idle share the time model adds for ``strategy`` (0 without pp)."""
    if getattr(strategy, "pp", 1) <= 1:
        return 0.0
    from batchfit.distributed.pp_schedules import bubble_fraction, parse_schedule

    return bubble_fraction(parse_schedule(strategy.pp_schedule, strategy.microbatches), strategy.pp)


def _split(strategy) -> tuple[int, int]:
    """(pp x cp x tp, cp): the ranks that split one sample's work, and the sequence's split among them."""
    share = strategy.world_size // strategy.dp
    return share, share // (strategy.tp * getattr(strategy, "pp", 1))


@dataclass(frozen=True)
class Bound:
    tokens_per_s: float
    formula: str
    """How it was computed, with its figures."""


@dataclass
class Evidence:
    """The floors, and what the traced rows have shown of them so far."""

    linear: LinearFlops
    peak_tflops: float
    mfu: float
    link_gb_per_s: float
    """The fastest link (GB/s per GPU and direction): TP's collectives take at least their bytes over it."""
    traced: dict[int, tuple[float, str]] = field(default_factory=dict)
    """By cp degree (1: none), the least FLOPs per token of the traced rows without pp, and whose."""
    flops_used: dict[int, float] = field(default_factory=dict)
    """By cp degree, the highest traced FLOPs floor a candidate was set aside by: a row below it breaks the bounds."""
    tp_held: str = ""
    """A traced TP row whose collectives held the TP floor ("": none yet, and the floor is not used)."""
    tp_used: bool = False
    tp_failed: bool = False
    broken: list[str] = field(default_factory=list)
    """Rows that fell below a floor a candidate was set aside by: then nothing is set aside."""

    def flops_per_token(self, strategy) -> tuple[float, str]:
        """The FLOPs per token the bound takes for ``strategy``, and where they came from, in words."""
        per_token, name = self.traced.get(_split(strategy)[1], (0.0, ""))
        if per_token > self.linear.flops_per_token:
            return per_token, f"{_flops(per_token)} per token from {name}'s trace"
        return self.linear.flops_per_token, self.linear.formula()

    def _tp_term(self, strategy) -> bool:
        return strategy.tp > 1 and getattr(strategy, "pp", 1) == 1 and bool(self.tp_held) and not self.tp_failed

    def bound(self, strategy, world: World) -> Bound:
        """The most tokens/s ``strategy`` on ``world`` could reach, with what is known now."""
        share, cp = _split(strategy)
        seq, idle = self.linear.tokens_per_sample, bubble(strategy)
        per_token, flops_source = self.flops_per_token(strategy)
        compute_s = seq * per_token / share / (self.peak_tflops * 1e12 * self.mfu) / (1 - idle)
        tp_s, tp_words = 0.0, ""
        if self._tp_term(strategy):
            sent = seq / cp * self.linear.tp_bytes_per_token(strategy.tp)
            tp_s = sent / (self.link_gb_per_s * 1e9)
            passes = 3 if self.linear.recomputed_params else 2
            tp_words = (f" + TP's {sent / 1e9:,.2f} GB a sample at {self.link_gb_per_s:,.0f} GB/s "
                        f"({self.linear.blocks} blocks x {passes} passes x {TP_SUBLAYERS} reductions of "
                        f"{self.linear.hidden:,} x 2 bytes a token, 2 x {strategy.tp - 1}/{strategy.tp} of them "
                        f"sent; held by {self.tp_held}'s trace)")
        tokens_per_s = strategy.dp * seq / (compute_s + tp_s)
        bubble_words = f" / (1 - bubble {idle:.3f})" if idle else ""
        # the formula with its figures, then where the FLOPs per token came from (a traced row's or the linear floor)
        return Bound(tokens_per_s, f"{strategy.dp} x {seq:,} tokens a sample / ({seq:,} x {_flops(per_token)} per "
                                   f"token / {share} rank{'s' if share > 1 else ''} / ({self.peak_tflops:,.0f} "
                                   f"TFLOP/s x MFU {self.mfu:.2f}){bubble_words}{tp_words}); {flops_source}")

    def set_aside(self, strategy) -> None:
        """A candidate is set aside by its bound now: later rows must hold what it rested on."""
        cp, per_token = _split(strategy)[1], self.flops_per_token(strategy)[0]
        if per_token > self.linear.flops_per_token:
            self.flops_used[cp] = max(self.flops_used.get(cp, 0.0), per_token)
        self.tp_used = self.tp_used or self._tp_term(strategy)

    def learn(self, strategy, row) -> bool:
        """Read a traced row (a ``StrategyPlan`` with its time); False once a row fell below a floor that
        a candidate was set aside by (or below the linear floor)."""
        if row.time is None or not row.micro_batch:
            return not self.broken
        share, cp = _split(strategy)
        tokens = row.micro_batch * self.linear.tokens_per_sample
        per_token = row.time.flops * share / tokens  # pp: the busiest rank's x pp, at least the whole's
        if per_token < self.linear.flops_per_token or per_token < self.flops_used.get(cp, 0.0) * (1 - 1e-9):
            self.broken.append(f"{row.strategy}: fewer FLOPs traced than the floor")
        if getattr(strategy, "pp", 1) == 1 and per_token < self.traced.get(cp, (float("inf"), ""))[0]:
            self.traced[cp] = (per_token, row.strategy)
        if strategy.tp > 1 and getattr(strategy, "pp", 1) == 1:
            if row.time.bytes_sent.get("tp", 0) < tokens / cp * self.linear.tp_bytes_per_token(strategy.tp):
                self.tp_failed = True
                if self.tp_used:
                    self.broken.append(f"{row.strategy}: fewer TP bytes traced than the floor")
            elif not self.tp_held:
                self.tp_held = row.strategy
        return not self.broken
