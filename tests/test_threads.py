"""Kernels use every CPU this process may run on unless the user chose a thread count."""

import os
import subprocess
import sys

from gcomp.runtime.threads import configure, default_threads

CPUS = len(os.sched_getaffinity(0))


def test_mpi_ranks_on_one_host_share_its_cpus():
    assert default_threads({}) == CPUS
    assert default_threads({"MPI_LOCALNRANKS": "2"}) == max(1, CPUS // 2)
    assert default_threads({"OMPI_COMM_WORLD_LOCAL_SIZE": str(4 * CPUS)}) == 1


def test_a_thread_count_the_user_set_is_kept():
    env = {"OMP_NUM_THREADS": "3"}
    configure(env)
    assert env == {"OMP_NUM_THREADS": "3"}
    env = {}
    configure(env)
    assert env == {"TVM_NUM_THREADS": str(CPUS)}


def test_tvm_thread_pool_follows_the_default():
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    code = "import gcomp, tvm; print(tvm.get_global_func('runtime.NumThreads')())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert int(out) == CPUS
