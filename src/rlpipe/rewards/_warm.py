"""Imported by the verifier pool's fork server before it forks a worker (``set_forkserver_preload``).

math-verify and sympy take ~0.4 s to import and their first parse builds parsers lazily; a worker that does
this on its first math sample spends that inside the iteration (each of the pool's workers, and every
replacement of a killed one). Done once here, each forked worker starts with them in place.
"""

import logging

try:
    from math_verify import parse

    parse("\\boxed{\\frac{1}{2}}")
except Exception as e:  # noqa: BLE001 - a cold worker still gives verdicts: it imports on its first math sample
    logging.getLogger(__name__).warning("verifier fork server not warmed (%s: %s); workers import on first use",
                                        type(e).__name__, e)
