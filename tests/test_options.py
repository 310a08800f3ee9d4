"""The option grammars (batchfit/options.py): each text parses once into its value, the value gives
the text back, and a bad text is refused with the one-line error that shows the grammar."""

from __future__ import annotations

import pytest

from batchfit.errors import OptionError
from batchfit.options import Checkpointing, LoRA, Loss, Offload, PrecisionSpec, Quantize, Routing
from batchfit.workload import StepOptions


@pytest.mark.parametrize(("parse", "text", "value"), [
    (Checkpointing.parse, "none", Checkpointing("none")),
    (Checkpointing.parse, "selective", Checkpointing("selective")),
    (Checkpointing.parse, "every:2", Checkpointing("every", 2)),
    (Loss.parse, "plain", Loss("plain")),
    (Loss.parse, "fused-linear", Loss("fused-linear")),
    (Loss.parse, "chunked:8", Loss("chunked", 8)),
    (Routing.parse, "worst", Routing("worst")),
    (Routing.parse, "capacity:1.25", Routing("capacity", 1.25)),
    (Offload.parse, "none", Offload()),
    (Offload.parse, "activations", Offload(activations=True)),
    (Offload.parse, "activations+params", Offload(activations=True, params=True)),
    (Quantize.parse, "int8", Quantize("int8")),
    (Quantize.parse, "nf4-dq", Quantize("nf4", double=True)),
    (LoRA.parse, "r=16", LoRA(16)),
    (LoRA.parse, "r=8,alpha=16,dora,targets=q_proj+v_proj", LoRA(8, 16, True, ("q_proj", "v_proj"))),
    (PrecisionSpec.parse, "bf16-mixed", PrecisionSpec("bf16-mixed")),
])
def test_each_text_parses_to_its_value_and_back(parse, text, value):
    assert parse(text) == value
    assert str(value) == text


def test_the_parts_read_downstream():
    assert Checkpointing.parse("every:3").every == 3 and Checkpointing.parse("every:3").by_position
    assert not Checkpointing.parse("every:1").by_position and not Checkpointing.parse("full").by_position
    assert Loss.parse("chunked:4").chunks == 4 and Loss.parse("plain").chunks is None
    assert Routing.parse("capacity:2").capacity_factor == 2.0
    assert Offload.parse("params+activations") == Offload(activations=True, params=True)  # either order
    assert str(Offload.parse("params+activations")) == "activations+params"  # one spelling back
    assert LoRA.parse("none") is None
    assert [PrecisionSpec.parse(p).fp8_recipe for p in ("fp8-rowwise", "fp8-tensorwise", "bf16")] == [
        "rowwise", "tensorwise", None]
    assert [PrecisionSpec.parse(p).bf16 for p in ("bf16", "bf16-mixed", "fp16-mixed", "fp8-rowwise")] == [
        True, True, False, False]


@pytest.mark.parametrize(("parse", "text", "says"), [
    (Checkpointing.parse, "every:0", "use none, full, selective or every:N"),
    (Checkpointing.parse, "every:+2", "use none, full, selective or every:N"),
    (Checkpointing.parse, "every", "use none, full, selective or every:N"),
    (Loss.parse, "chunked:", "use plain, chunked:N"),
    (Loss.parse, "chunked", "use plain, chunked:N"),
    (Routing.parse, "capacity:0", "capacity:F (e.g. capacity:1.25"),
    (Routing.parse, "capacity:nan", "capacity:F (e.g. capacity:1.25"),
    (Routing.parse, "capacity:x", "capacity:F (e.g. capacity:1.25"),
    (Offload.parse, "activations+activations", "use none, activations, params or activations+params"),
    (Offload.parse, "none+params", "use none, activations, params or activations+params"),
    (Quantize.parse, "nf8", "use one of none, nf4, nf4-dq"),
    (LoRA.parse, "alpha=16", "use none or r=N[,alpha=A][,dora][,targets=a+b]"),
    (LoRA.parse, "r=16,r=8", "use none or r=N"),
    (LoRA.parse, "r=16,targets=q+", "use none or r=N"),
    (PrecisionSpec.parse, "fp16", "use one of fp32, bf16-mixed"),
])
def test_a_bad_text_is_refused_in_one_line(parse, text, says):
    with pytest.raises(OptionError, match="^[^\n]*$") as error:
        parse(text)
    assert says in str(error.value)


def test_step_options_keep_the_text_and_carry_the_values():
    options = StepOptions(checkpointing="every:2", loss="chunked:8", routing="capacity:1.5", offload="activations",
                          lora="r=4")
    assert (options.checkpointing, options.checkpointing_spec) == ("every:2", Checkpointing("every", 2))
    assert options.loss_spec.chunks == 8 and options.routing_spec.capacity_factor == 1.5
    assert options.offload_spec == Offload(activations=True) and options.lora_spec == LoRA(4)
    assert options.to_json()["checkpointing"] == "every:2" and "checkpointing_spec" not in options.to_json()
    with pytest.raises(OptionError, match="unknown checkpointing 'every:x'"):
        StepOptions(checkpointing="every:x")
