"""Prefect tasks: small I/O adapters (read URI → core function → write URI) with retries/timeouts."""
