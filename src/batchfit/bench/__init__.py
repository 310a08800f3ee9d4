"""``batchfit bench``'s engine: timed real steps (throughput, allocated vs reserved memory,
leaks) at each batch size. Imports the layers below, never another engine."""
