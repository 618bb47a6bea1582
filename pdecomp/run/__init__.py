"""A run from its gate to its summary: the training loop, evaluation, checkpoints, resuming,
and opening a finished run directory. Imports the floors below it."""
