"""How many threads the CPU kernels use.

TVM's runtime sizes its thread pool once, on the first parallel kernel, from
``TVM_NUM_THREADS`` (or ``OMP_NUM_THREADS``), else from the hardware; on x86 it
assumes two hardware threads per core and starts half of them, which is one
thread on a 2-vCPU machine (measured there: an arxiv-synth GCN training step
224 ms with the default, 118 ms with 2 threads).  Unless the user chose,
gcomp asks for every CPU this process may run on, shared among the MPI ranks
started on this host, before any kernel runs (``gcomp/__init__.py``).
"""

from __future__ import annotations

import os

USER_VARS = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")
# ranks of this job on this host, as MPICH/Hydra, Open MPI and MVAPICH tell them
_LOCAL_RANKS_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def default_threads(environ=os.environ) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = next((int(environ[v]) for v in _LOCAL_RANKS_VARS
                  if environ.get(v, "").strip().isdigit() and int(environ[v]) > 0), 1)
    return max(1, (cpus or 1) // local)


def configure(environ=os.environ) -> None:
    """Set ``TVM_NUM_THREADS`` to ``default_threads()`` unless the user set a thread count."""
    if not any(environ.get(v) for v in USER_VARS):
        environ["TVM_NUM_THREADS"] = str(default_threads(environ))
