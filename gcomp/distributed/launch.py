"""Running gcomp under ``mpiexec``: world detection, failure handling, compile order.

``mpiexec -n K gcomp train ...`` starts K copies of the command line; each finds
its rank from the environment (MPICH/Hydra ``PMI_*``, Open MPI ``OMPI_COMM_WORLD_*``)
without initializing MPI, so a plain ``gcomp train`` never loads mpi4py.

Failures never hang the job:

* an exception on any rank prints ``gcomp: error: rank R/K: ...`` and aborts the
  whole job (``MPI_Abort``, exit code 2 for user errors, 1 otherwise);
* a rank that dies is noticed by the launcher (Hydra kills the other ranks), and
  a rank that hangs makes the others' waits run past ``GCOMP_DIST_TIMEOUT``
  seconds (default 300), which is an error as above.

``GCOMP_DIST_FAULT=RANK:STEP:KIND`` (KIND: ``raise``, ``die``, ``hang``) injects a
failure at a training step, for the tests.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

from gcomp.errors import GcompError

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")


def _env_int(names) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


def world_size() -> int:
    """Ranks in this job according to the launcher's environment (1 outside mpiexec)."""
    return _env_int(_SIZE_VARS) or 1


def world_rank() -> int:
    return _env_int(_RANK_VARS) or 0


def run_distributed(fn, *args) -> int:
    """Run ``fn(*args, comm=Comm)`` on every rank; any exception aborts the whole job."""
    from gcomp.distributed.halo import Comm
    try:
        comm = Comm()
    except ImportError as e:
        print(f"gcomp: error: this is an MPI job ({world_size()} ranks) but mpi4py cannot be "
              f"imported: {e}", file=sys.stderr)
        return 2
    try:
        rc = fn(*args, comm=comm)
        comm.barrier("the end of the run")
        return rc
    except BaseException as e:  # noqa: BLE001 - every failure must end the whole job
        user = isinstance(e, GcompError)
        msg = str(e) if user else f"{type(e).__name__}: {e}"
        if os.environ.get("GCOMP_DEBUG") or not user:
            traceback.print_exc()
        # one write, newline included: two ranks' print() calls interleaved their halves
        sys.stderr.write(f"gcomp: error: rank {comm.rank}/{comm.size}: {msg}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # the launcher forwards our stderr asynchronously and drops what it has not read
        # when the job is torn down: give it a moment, or the error may never be seen
        time.sleep(1.0)
        comm.comm.Abort(2 if user else 1)
        return 2  # not reached


def in_turn(comm, build):
    """``build()`` on rank 0 first, then on the others (they hit its compile cache)."""
    if comm.rank == 0:
        out = build()
        comm.barrier("rank 0 compiling the model")
        return out
    comm.barrier("rank 0 compiling the model")
    return build()


def maybe_fault(rank: int, step: int) -> None:
    """The failure ``GCOMP_DIST_FAULT`` asks for at this rank and step, if any."""
    spec = os.environ.get("GCOMP_DIST_FAULT")
    if not spec:
        return
    try:
        r, s, kind = spec.split(":")
        r, s = int(r), int(s)
    except ValueError:
        raise GcompError(f"GCOMP_DIST_FAULT must be RANK:STEP:KIND, got {spec!r}") from None
    if r != rank or s != step:
        return
    if kind == "raise":
        raise GcompError(f"injected failure at step {step}")
    if kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise GcompError(f"GCOMP_DIST_FAULT: unknown kind {kind!r} (raise, die, hang)")
