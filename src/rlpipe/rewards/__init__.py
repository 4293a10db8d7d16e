"""Verifiers: typed results, a registry by name, and the built-in verifiers."""

from rlpipe.rewards.base import VerifyResult, get_verifier, register_verifier, verifier_names

# Importing the built-ins registers them.
from rlpipe.rewards import closeness as _closeness  # noqa: F401,E402
from rlpipe.rewards import code as _code  # noqa: F401,E402
from rlpipe.rewards import format as _format  # noqa: F401,E402
from rlpipe.rewards import math as _math  # noqa: F401,E402

__all__ = ["VerifyResult", "get_verifier", "register_verifier", "verifier_names"]
