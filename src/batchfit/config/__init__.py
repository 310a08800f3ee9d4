"""Flags, a ``--trainer`` file (HF TrainingArguments / TRL SFTConfig) and a torchtitan job toml made
into the same typed objects: StepOptions, the target, plan's PlanRequest.

One floor below ``cli/`` (which declares the options and prints) and above the engines and
``integrations/`` (whose TrainingArguments mapping it reads): a command's merging lives here, so
``cli/`` stays thin and the same merging is callable from Python.
"""
