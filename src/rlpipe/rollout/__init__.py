"""Generation engines (vLLM, HF generate) behind one protocol, and their process-wide cache."""

from rlpipe.rollout.base import Completion, RolloutEngine, SamplingConfig, WeightSyncError

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "WeightSyncError"]
