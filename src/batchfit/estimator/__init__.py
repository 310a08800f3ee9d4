"""``batchfit estimate``'s engine: the traced memory curve searched for the largest batch
that fits, and what to change when nothing fits. Imports the layers below, never another engine.

Named ``estimator`` (not ``estimate``) so that ``batchfit.estimate`` stays the function."""
