"""OpenMP's wait policy, set once, before torch loads its OpenMP runtime (which reads it then).

torch's CPU kernels run on an OpenMP pool. Left to its own default, the OpenMP runtime (GNU's, in
torch's wheels) has a thread that reaches a barrier spin for a while before it sleeps; on cores
other work also wants, the spinning threads take the time the thread still computing needs, and a
step can become many times slower (docs/operations.md, "CPU threads", measured by
`bench/cli_threads.py`). The commands set `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep at once)
unless the environment sets it; an empty `OMP_WAIT_POLICY=` keeps OpenMP's own default.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Optional

DEFAULT_WAIT_POLICY = "PASSIVE"


def configure_openmp(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Set the wait policy in `environ` (the process's) unless it is set; returns the policy in force
    (None: OpenMP's own default). Only effective before torch is imported: the runtime reads it once,
    when torch loads it."""
    environ = os.environ if environ is None else environ
    policy = environ.get("OMP_WAIT_POLICY")
    if policy is None:
        environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
        return DEFAULT_WAIT_POLICY
    if not policy.strip():
        del environ["OMP_WAIT_POLICY"]  # asked for OpenMP's own default
        return None
    return policy
