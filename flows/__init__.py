"""Prefect flows: sft, prepare_data (and, as they land, train, iteration, evaluate, reward_model)."""
