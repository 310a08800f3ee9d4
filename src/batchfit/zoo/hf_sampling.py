"""transformers' sampling loop (``GenerationMixin._sample``, transformers 5) as TRL's GRPOTrainer runs it through
``model.generate`` (``_generate_single_turn``), for the traced generation of an ``hf:`` policy (``zoo/hf_grpo.py``).

Mirrored, tensor for tensor, because generation's peak is often at a new token rather than at the prompt's forward
(a bf16 model's prompt activations are half an fp32 one's, while sampling stays fp32):

- what ``generate`` holds beside the loop: the attention mask TRL passes (left-padded ones, ``[rows, prompt]``
  int64), the position ids it makes from it (``_prepare_position_ids_for_generation``; passed to the model, whose
  rotary embedding is then per row), the special tokens' tensors and the unfinished-rows flags;
- each new token, in ``_sample``'s order: the forward on a copy of the last token and its position with the KV
  cache (the prefill on a copy of the prompts), the positions and the mask grown by one column, the last logits
  copied to fp32, the logits processors (the user's sampling settings: transformers' own
  processor classes, built as ``_get_logits_processor`` builds them), their softmax, the multinomial draw, the
  finished rows' tokens set to the pad token, the token appended to the sequences, the stopping criteria
  (transformers' own: the length, then EOS) and the unfinished rows updated;
- the lifetimes: the fp32 copy, the processed scores and the probabilities of one token stay alive through the next
  token's forward (``_sample`` rebinds each only when it makes the next one); the forward's output is dropped at the
  end of each token (``del outputs``).

The attention mask is held but not passed to the model: all ones, transformers builds no
mask from it on a GPU, and on fake tensors it cannot read the values to know (``zoo/hf.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from batchfit.options import adds_logits_processor

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor | None, object], object]
"""(model, input ids of this step, their position ids, cache or None) -> the model's output (``.logits``,
``.cache``)."""


def logits_processors(transformers, sampling: tuple[tuple[str, float], ...], prompt_len: int,
                      eos: torch.Tensor, attention_mask: torch.Tensor) -> list:
    """The processors ``generate`` runs on each new token's fp32 logits for these settings (transformers'
    ``_get_logits_processor``: its order and its conditions; every processor but the length ones a warper, which
    runs because TRL samples). ``eos``: the EOS ids' tensor; ``attention_mask``: the prompts' mask (the repetition
    penalty skips each row's left padding)."""
    settings = {name: value for name, value in sampling if adds_logits_processor(name, value)}
    generation, device = transformers.generation, eos.device
    processors = []
    if "repetition_penalty" in settings:
        padding = (attention_mask != 0).int().argmax(dim=1)
        processors.append(generation.RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"],
                                                                      prompt_ignore_length=padding))
    # generate turns min_new_tokens into a min_length too (_prepare_generated_length)
    min_new = int(settings["min_new_tokens"]) if "min_new_tokens" in settings else None
    min_length = prompt_len + min_new if min_new is not None else int(settings.get("min_length", 0))
    if min_length > 0:
        processors.append(generation.MinLengthLogitsProcessor(min_length, eos, device=device))
    if min_new:
        processors.append(generation.MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos, device=device))
    warpers = {"temperature": lambda v: generation.TemperatureLogitsWarper(v),
               "top_k": lambda v: generation.TopKLogitsWarper(top_k=int(v)),
               "top_p": lambda v: generation.TopPLogitsWarper(top_p=v),
               "min_p": lambda v: generation.MinPLogitsWarper(min_p=v),
               "typical_p": lambda v: generation.TypicalLogitsWarper(mass=v),
               "epsilon_cutoff": lambda v: generation.EpsilonLogitsWarper(epsilon=v),
               "eta_cutoff": lambda v: generation.EtaLogitsWarper(epsilon=v, device=device)}
    processors += [make(settings[name]) for name, make in warpers.items() if name in settings]
    return processors


def sample(transformers, model: nn.Module, prompts: torch.Tensor, new_tokens: int, forward: Forward, *,
           sampling: tuple[tuple[str, float], ...] = (), eos_token_id: int = 0, pad_token_id: int = 0) -> torch.Tensor:
    """``new_tokens`` sampled after ``prompts`` as ``generate`` samples them (see the module); returns prompts and
    completions ``[rows, prompt + new_tokens]`` (generate's ``input_ids``). Position ids are made and passed where
    the model's forward takes them, as generate does (else ``forward`` gets None)."""
    rows, prompt_len = prompts.shape
    attention_mask = torch.ones_like(prompts)  # TRL's pad(): its ones, held by generate's inputs throughout
    # _prepare_position_ids_for_generation: from the mask, kept (and grown) in generate's model_kwargs
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel generates with it
    takes_positions = "position_ids" in inspect.signature(base.forward).parameters
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0) if takes_positions else None
    eos = torch.tensor([eos_token_id], device=prompts.device)  # _prepare_special_tokens: eos, pad
    pad = torch.tensor(pad_token_id, device=prompts.device)
    processors = logits_processors(transformers, sampling, prompt_len, eos, attention_mask)
    generation = transformers.generation  # _get_stopping_criteria: the length, then EOS
    stopping = generation.StoppingCriteriaList([generation.MaxLengthCriteria(prompt_len + new_tokens),
                                                generation.EosTokenCriteria(eos)])
    unfinished = torch.ones(rows, dtype=torch.long, device=prompts.device)
    input_ids, positions, mask, cache = prompts, position_ids, attention_mask, None
    logits = scores = probs = next_tokens = inputs = None
    for token in range(new_tokens):
        if token == 0:  # _prefill: its inputs (a copy of the prompts) die with it
            outputs = forward(model, input_ids.clone(), positions, cache)
        else:  # prepare_inputs_for_generation: the last token and its position, copied; alive to the next token's
            inputs = (input_ids[:, -1:].clone(), None if positions is None else positions[:, -1:].clone())
            outputs = forward(model, *inputs, cache)
        cache = outputs.cache
        # _update_model_kwargs_for_generation: one more position, one more column of the mask
        if positions is not None:
            positions = torch.cat([positions, torch.arange(1, dtype=positions.dtype, device=positions.device)
                                   .view(1, -1) + positions[:, -1:] + 1], dim=-1)
        mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        scores = _processed(processors, input_ids, logits)  # the last token's scores live until this returns
        probs = nn.functional.softmax(scores, dim=-1)
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        next_tokens = next_tokens * unfinished + pad * (1 - unfinished)  # finished rows take the pad token
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping(input_ids, None)
        finished = unfinished.max() == 0  # StopCheck: generate reads it (a value fake tensors do not have)
        del outputs, finished
    del logits, scores, probs, next_tokens, inputs, mask, positions, unfinished
    return input_ids


def _processed(processors: list, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``LogitsProcessorList.__call__``: each processor's output replaces the one before (freed as it is)."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores
