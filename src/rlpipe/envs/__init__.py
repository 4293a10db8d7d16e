"""Agent environments: the ``reset``/``step`` protocol and its registry (:mod:`.base`), the action format,
episodes with their limits and verdicts, the built-in environments (``calculator``, ``guess``), and the specs
a run names them by (:mod:`.spec`).

Environment specs are YAML files (``configs/envs/*.yaml``) validated like run configs::

    from rlpipe.envs import load_env_spec
    spec = load_env_spec("configs/envs/calculator.yaml")
    episode = Episode(spec.make(), task={}, seed=0, limits=spec.limits)

The multi-turn rollout over them is :mod:`rlpipe.rollout.multiturn`; environments in their own
sandboxes are :mod:`rlpipe.envs.sandboxed`, the environment service :mod:`rlpipe.services.env`; a run config picks all of this in
its ``agent:`` section.
"""

from rlpipe.envs.actions import Action, InvalidAction, format_action, parse_action
from rlpipe.envs.base import EnvLimits, Environment, StepResult, TaskError, ToolEnvironment, register_env
from rlpipe.envs.episode import Episode, Step, completeness_problems
from rlpipe.envs.spec import EnvSpec, env_class, env_names, load_env_spec, tool_free_envs

__all__ = [
    "Action", "EnvLimits", "EnvSpec", "Environment", "Episode", "InvalidAction", "Step", "StepResult", "TaskError", "ToolEnvironment",
    "completeness_problems", "env_class", "env_names", "format_action", "load_env_spec", "parse_action", "register_env",
    "tool_free_envs",
]
