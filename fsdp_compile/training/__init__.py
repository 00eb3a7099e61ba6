"""Around the training loop: checkpoints (sharded and full state dicts) and gradient clipping."""
