"""How busy the machine is with other processes' work, from /proc/stat (Linux).

Timings taken while another process holds a core read slow: the format calibration
keeps none of those on disk (``gcomp/codegen/calibrate.py``) and the benchmarks redo a
round that ran beside other load (``bench/protocol.py``).
"""

from __future__ import annotations

import os
import time


class CpuMonitor:
    """CPU time used by *other* processes: /proc/stat busy time minus this process's own
    (threads and waited-for children).  ``cores()`` = average cores they kept busy since the
    last call.  The machine is shared; a run with other load is recorded as such."""

    def __init__(self):
        self._last = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(v[:8]) - v[3] - v[4]) / hz  # all but idle and iowait
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return time.monotonic(), busy, own

    def cores(self) -> float | None:
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] - last[0] <= 0:
            return None
        other = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, other / (now[0] - last[0]))
