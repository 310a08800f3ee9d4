"""The ``--trainer`` part of a report: what the TrainingArguments became, what was not used, and
the answer in the Trainer's terms (a JSON ``trainer`` section in, Markdown out; no torch)."""

from __future__ import annotations

import json


def _value(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    text = text if len(text) <= 80 else f"{text[:77]}..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"  # a | would end the table cell


def trainer_markdown(section: dict) -> str:
    """The section, for the end of report.md."""
    lines = ["## From the TrainingArguments", "",
             f"Read from `{section['source']}`: global batch {section['per_device_train_batch_size']} x "
             f"{section['gradient_accumulation_steps']} x {section['world_size']} device(s) = "
             f"{section['global_batch']}.", ""]
    answer = section.get("answer")
    if answer and answer.get("per_device_train_batch_size"):
        lines += [f"**Answer: per_device_train_batch_size={answer['per_device_train_batch_size']}, "
                  f"gradient_accumulation_steps={answer['gradient_accumulation_steps']}** for global batch "
                  f"{answer['global_batch']} over {answer['world_size']} device(s) (largest micro-batch "
                  f"{answer['max_micro_batch']}, {answer['source']}).", ""]
    elif answer:
        lines += [f"**No per-device batch for global batch {answer['global_batch']}.**", ""]
    lines += [f"- note: {note}" for note in (answer or {}).get("notes", [])]
    lines += ["", "| field | value | batchfit option | note |", "|---|---|---|---|"]
    lines += [f"| {u['field']} | {_value(u['value'])} | `{u['option']}` | {u['why']} |"
              for u in section["trainer_fields_used"] if u.get("option")]
    lines += ["", "Not used (`trainer_fields_unused`):", "", "| field | value | why |", "|---|---|---|"]
    lines += [f"| {u['field']} | {_value(u['value'])} | {u['why']} |" for u in section["trainer_fields_unused"]]
    return "\n".join(lines) + "\n"
