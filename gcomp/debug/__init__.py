"""Pass debugging: instruments that print, dump, time and reproduce pass pipelines."""

from gcomp.debug.instruments import (DumpIR, PassTiming, PrintAfter, PrintAfterChange,
                                     Reproducer, replay)

__all__ = ["PrintAfter", "PrintAfterChange", "DumpIR", "PassTiming", "Reproducer", "replay"]
