"""Prompt datasets: the synthetic arithmetic family, user files, validation and versions."""

from rlpipe.data.arithmetic import build_arithmetic, build_arithmetic_rlhf
from rlpipe.data.expressions import build_expressions
from rlpipe.data.prompts import Finding, PromptFileError, dataset_version, load_prompts, validate_prompts

BUILTIN = {"builtin:arithmetic": build_arithmetic, "builtin:expressions": build_expressions,
           "builtin:arithmetic-rlhf": build_arithmetic_rlhf}

__all__ = ["BUILTIN", "Finding", "PromptFileError", "build_arithmetic", "build_expressions", "dataset_version", "load_prompts", "validate_prompts"]
