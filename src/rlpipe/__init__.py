"""rlpipe: LLM reinforcement learning (RLVR, RLHF, agentic RL) as Prefect flows.

The package is the pure core: it imports neither prefect, mlflow, boto3, vllm nor deepspeed at
module level, so its pieces can be used and tested alone.
"""

__version__ = "0.1.0"
