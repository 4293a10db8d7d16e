"""Models, log-prob computation, supervised and RL updates, checkpoints."""
