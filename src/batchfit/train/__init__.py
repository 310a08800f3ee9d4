"""THE training step (forward, loss, backward, accumulation, precision and GradScaler, the
optimizer step, checkpointing) and what runs it: the timed-step loop and the failure classes.

Every engine runs this one step: the tracer on fake tensors, probe and bench on a device,
sweep and noise in their training runs, ElasticStep in a user's loop."""
