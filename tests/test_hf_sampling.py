"""Generation as transformers' ``generate`` samples under TRL (``zoo/hf_sampling.py``): the GRPOConfig's sampling
settings read as logits processors, and what the loop holds, by hand. Against a real TRL step (bf16 weights, whose
generation peaks at a new token): ``tests/test_trl_grpo.py``'s slow truth, within 1 KB."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.errors import OptionError
from batchfit.integrations.trainer_args import from_training_arguments
from batchfit.integrations.trainer_fields import NO_MEMORY
from batchfit.options import Rollout
from batchfit.trace.memory import MemoryTracker

transformers = pytest.importorskip("transformers")

from batchfit.zoo.hf_sampling import sample  # noqa: E402

GRPO = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 8}


def test_the_sampling_fields_and_generation_kwargs_become_logits_processors():
    """TRL passes temperature, top_p, top_k, min_p, repetition_penalty to GenerationConfig, then generation_kwargs
    over them; only what adds a processor is kept (TRL's defaults 1, 1, 0 add none), in transformers' order."""
    args = {**GRPO, "temperature": 0.7, "top_p": 1.0, "top_k": 0,
            "generation_kwargs": {"min_new_tokens": 4, "num_beams": 1}}
    mapping = from_training_arguments(args, check_fields=False)
    assert mapping.rollout.sampling == (("min_new_tokens", 4), ("temperature", 0.7))
    used = {u.field: u for u in mapping.used}
    assert used["temperature"].option == "sampling with temperature 0.7"
    assert used["generation_kwargs"].option == "sampling with min_new_tokens 4"
    assert "not read, traced as plain sampling: num_beams" in used["generation_kwargs"].why
    unused = {u.field: u.why for u in mapping.unused}
    assert unused["top_p"] == unused["top_k"] == NO_MEMORY  # at TRL's defaults: no processor, no line said
    as_text = from_training_arguments({**GRPO, "generation_kwargs": '{"top_k": 20}'}, check_fields=False)
    assert as_text.rollout.sampling == (("top_k", 20),)


def test_a_setting_batchfit_does_not_trace_is_refused_in_one_line():
    with pytest.raises(OptionError, match="num_beams=4 is not one batchfit traces") as error:
        Rollout(sampling=(("num_beams", 4),))
    assert "\n" not in str(error.value)



@pytest.mark.parametrize(("fields", "says"), [
    ({"temperature": 0.0}, "temperature=0.0 would make transformers' generate refuse: give temperature > 0"),
    ({"top_k": -1}, "top_k=-1 would make transformers' generate refuse: give top_k > 0"),
    ({"repetition_penalty": 0}, "repetition_penalty=0 would make transformers' generate refuse"),
    ({"generation_kwargs": {"min_p": 1.5}}, "min_p=1.5 would make transformers' generate refuse: give min_p in"),
    ({"temperature": "hot"}, "temperature='hot' is not a number"),
    ({"top_k": 2.5}, "top_k=2.5 is not an integer"),
])
def test_a_sampling_value_generate_refuses_is_refused_before_the_trace(fields, says):
    """transformers' processors raise on these in the middle of the traced step (temperature 0: "has to be a strictly
    positive float"; repetition_penalty 0 as `penalty`); the mapping says which field, in one line, before."""
    with pytest.raises(OptionError, match=re.escape(says)) as error:
        from_training_arguments({**GRPO, **fields}, check_fields=False)
    assert "\n" not in str(error.value)


def test_sampling_values_are_typed_as_the_processors_take_them():
    """A JSON 2 for a float setting is 2.0 (RepetitionPenaltyLogitsProcessor refuses the int 2), a 5.0 for top_k is
    5; null is unset, and a value at which generate adds no processor is never refused (top_p 1.5: none)."""
    args = {**GRPO, "temperature": 2, "repetition_penalty": 2, "top_k": 5.0, "min_p": None, "top_p": 1.5}
    sampling = from_training_arguments(args, check_fields=False).rollout.sampling
    assert sampling == (("repetition_penalty", 2.0), ("temperature", 2.0), ("top_k", 5))
    assert [type(value) for _, value in sampling] == [float, float, int]


R, P, V, N = 4, 8, 1024, 3
ROW_BYTES = R * V * 4  # one fp32 [rows, vocab]: 16,384 B


class LastLogits(nn.Module):
    """A model that makes only its output: the last position's logits, fp32 (generate's logits_to_keep=1)."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 1, V), cache=None)


def sampled_peak(sampling: tuple) -> int:
    with FakeTensorMode(), MemoryTracker(round_bytes=1) as tracker:
        prompts = torch.zeros(R, P, dtype=torch.long)
        before = tracker.live_bytes
        sample(transformers, LastLogits(), prompts, N, lambda model, ids, positions, cache: model(ids, positions),
               sampling=sampling)
        return tracker.peak_bytes - before


def test_sampling_holds_what_generate_holds_between_two_tokens():
    """Sampling the third token, plain sampling holds four fp32 [rows, vocab] at once: the model's logits, their
    fp32 copy (also the scores: no processor), the second token's probabilities, and either the second token's
    scores (while the copy is made) or the new probabilities (``_sample`` rebinds each only once the new one
    exists). Beside them, int64: TRL's attention mask and the position ids made from it
    (4 x 8 x 8 B each), the sequences so far (4 x 10 x 8), the positions and the mask grown to 11 columns
    (4 x 11 x 8 each), the last token and its position copied for the forward (4 x 8 each), the unfinished rows'
    flags and the last token drawn (4 x 8 each), the EOS and pad ids (8 each). A temperature adds one fp32
    [rows, vocab]: the divided scores, beside the copy, and the last token's, until the new ones replace them."""
    small = 256 + 256 + 320 + 352 + 352 + 32 + 32 + 32 + 32 + 8 + 8
    assert sampled_peak(()) == 4 * ROW_BYTES + small == 67_216
    assert sampled_peak((("temperature", 0.7),)) == 5 * ROW_BYTES + small


def test_beams_or_more_sequences_per_completion_are_refused_in_one_line():
    # each beam (or returned sequence) holds its own cache: traced as one, the generation would read too low
    from batchfit.errors import OptionError
    from batchfit.integrations.trainer_sampling import sampling

    for name in ("num_beams", "num_return_sequences"):
        with pytest.raises(OptionError, match=f"generation_kwargs {name}=4 is not traced.*drop {name}"):
            sampling({"generation_kwargs": {name: 4}})
    assert sampling({"generation_kwargs": {"num_beams": 1, "do_sample": True}}).kwargs_not_read == [
        "num_beams", "do_sample"]
