"""Prompt datasets: the synthetic arithmetic family, user files, validation and versions."""

from rlpipe.data.arithmetic import build_arithmetic
from rlpipe.data.prompts import Finding, PromptFileError, dataset_version, load_prompts, validate_prompts

__all__ = ["Finding", "PromptFileError", "build_arithmetic", "dataset_version", "load_prompts", "validate_prompts"]
