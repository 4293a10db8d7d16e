"""What a run holds while it runs in this process: its context (resolved once) and its services.

- :mod:`rlpipe.runtime.context`: the run's settings, object store, run folder, fingerprints, resolved
  model paths and tracker, built once by the train flow; tasks ask for it by run id.
- :mod:`rlpipe.runtime.services`: the long-lived services (engine, trainer, verifier pool, reward model).
- :mod:`rlpipe.runtime.assembly`: how the services the config names are built and checked.
"""

from rlpipe.runtime.context import ModelPaths, RunContext, find_context, forget_context, register_context, run_context
from rlpipe.runtime.services import RunServices, register_services, services, stop_services

__all__ = [
    "ModelPaths", "RunContext", "RunServices", "find_context", "forget_context", "register_context", "register_services", "run_context",
    "services", "stop_services",
]
