"""Training: models (`model`), data and tokenizer, objectives, optimizer, checkpoints, metrics, and
the `trainer` that composes them."""
