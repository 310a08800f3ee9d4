"""The full-depth allocation stream written by ``trace/stream.py`` from depths 2, 3, 4, against the
whole model's trace, for the recipes where only adapters train or the optimizer is 8-bit: a
12-block tiny Llama (hidden 128, seq 32, batch 2), event for event and the reserved peak
replayed on an RTX 4090. The fast version is ``tests/test_stream.py`` (LoRA, QLoRA, 10 blocks).

    PYTHONPATH=src python benchmarks/stream_recipes.py

Writes benchmarks/results/stream-recipes-<date>.json.
"""

from __future__ import annotations

import time

import torch

from _common import write_result
from batchfit import StepOptions, Workload, get_device
from batchfit.trace import depth, stream
from batchfit.trace.point import replay_reserved
from batchfit.trace.session import TraceSession

BLOCKS = 12
RECIPES = {
    "lora r8 (adamw)": StepOptions(lora="r=8"),
    "qlora nf4-dq, paged-adamw-8bit, bf16-mixed, checkpointing": StepOptions(
        quantize="nf4-dq", lora="r=16", optimizer="paged-adamw-8bit", precision="bf16-mixed", checkpointing="full"),
    "nf4 lora r8, paged-adamw-8bit": StepOptions(quantize="nf4", lora="r=8", optimizer="paged-adamw-8bit"),
    "fp4 dora r8": StepOptions(quantize="fp4", lora="r=8,dora"),
    "int8 lora r8, adamw-8bit": StepOptions(quantize="int8", lora="r=8", optimizer="adamw-8bit"),
    "lora r8, paged-lion-8bit": StepOptions(lora="r=8", optimizer="paged-lion-8bit"),
    "full fine-tune, adamw-8bit": StepOptions(optimizer="adamw-8bit"),
}


def llama() -> Workload:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344,
                                            num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=64, attn_implementation="sdpa"))

    return Workload(name=f"llama-{BLOCKS}l", build_model=build,
                    make_batch=lambda b, d: torch.randint(0, 512, (b, 32), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=32)


def check(options: StepOptions) -> dict:
    workload, seen, streams = llama(), depth.Depth(), {}
    for d in depth.DEPTHS:
        with TraceSession(depth.at_depth(workload, d, seen), options) as session:
            session.trace(2, fresh=True)
            streams[d] = stream.without_cut(session.fresh_stream, seen.cuts[d])
    with TraceSession(workload, options) as session:
        session.trace(2, fresh=True)
        whole = session.fresh_stream
    started = time.process_time()
    written = stream.extend(streams, seen.blocks)
    write_s = time.process_time() - started
    device = get_device("rtx4090-24gb")
    return {"events": len(whole), "written": written is not None,
            "equal_event_for_event": written is not None and stream._canonical(written) == stream._canonical(whole),
            "reserved_written": None if written is None else replay_reserved(written, device)[0],
            "reserved_whole": replay_reserved(whole, device)[0], "write_cpu_s": round(write_s, 3)}


def main() -> None:
    rows = []
    for name, options in RECIPES.items():
        row = {"recipe": name, **check(options)}
        rows.append(row)
        print(f"{name}: written {row['written']}, equal {row['equal_event_for_event']}, reserved "
              f"{row['reserved_written']} vs whole {row['reserved_whole']} ({row['events']} events)", flush=True)
    print(f"wrote {write_result('stream-recipes', {'blocks': BLOCKS, 'batch_size': 2, 'rows': rows})}")


if __name__ == "__main__":
    main()
