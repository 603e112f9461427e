"""Training: state, optimizers, the jitted step, checkpoints, metrics and the loop."""
