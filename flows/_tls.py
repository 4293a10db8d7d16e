"""One TLS context per CA file for Prefect's API clients, instead of one per client.

Prefect 3 builds a new ``PrefectClient`` for the parent task run that stands for each subflow run
(``Task.create_run`` → ``get_client()``), and every client builds an ``ssl.SSLContext`` by parsing its CA
bundle: ~28 ms of CPU on the 2-core machine, on the path that starts each iteration's flow run, and
also for an ``http://`` API, where the context is never used (benchmarks/history.md, "The flow run's
start"). A context is safe to share between clients and threads, so the one built for a CA file (and
mode) is reused until that file changes; what each client verifies is unchanged.
"""

from __future__ import annotations

import os
import ssl
import threading
import types
from typing import Any

# The Prefect modules that build a context per client (pinned Prefect 3.7; a module that no longer
# does is left alone). prefect._internal.websockets builds one only for wss:// and is not patched.
MODULES = ("prefect.client.orchestration", "prefect._internal.version_checking")

_lock = threading.Lock()
_contexts: dict[tuple, ssl.SSLContext] = {}


def _key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    cafile = kwargs.get("cafile")  # keyword-only in ssl.create_default_context
    stamp = None
    if cafile:
        try:
            st = os.stat(cafile)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = "missing"  # ssl raises below, as it would unshared
    return args, tuple(sorted(kwargs.items())), stamp


def shared_default_context(*args: Any, **kwargs: Any) -> ssl.SSLContext:
    """``ssl.create_default_context`` with the result kept per arguments and CA file version."""
    key = _key(args, kwargs)
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = ssl.create_default_context(*args, **kwargs)
        return ctx


def _ssl_with_shared_contexts() -> types.ModuleType:
    proxy = types.ModuleType("ssl")  # the real module's names, but create_default_context shares
    proxy.__dict__.update(vars(ssl))
    proxy.create_default_context = shared_default_context
    return proxy


def share_tls_contexts() -> list[str]:
    """Point the Prefect client modules' ``ssl`` at a proxy whose ``create_default_context`` shares;
    returns the modules patched. Idempotent."""
    import importlib

    patched = []
    proxy = None
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "ssl", None)
        if getattr(current, "create_default_context", None) is shared_default_context:
            patched.append(name)
        elif current is ssl:
            proxy = proxy or _ssl_with_shared_contexts()
            module.ssl = proxy
            patched.append(name)
    return patched
