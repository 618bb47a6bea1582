"""The method (docs/method.md): components, CI functions, masks, losses, the
adversary, the training step, the evaluation metrics and their plots. Imports `core`."""
