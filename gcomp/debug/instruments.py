"""Instruments for the pass manager (TVM's ``PassInstrument`` hooks, MLIR's options).

    ctx = PassContext(instruments=[PrintAfter(), PassTiming(), DumpIR("ir/"),
                                   Reproducer("repro/")], disabled={"fuse_aggregate"})
    art = compile_model(model, ctx=ctx)

* ``PrintAfter(passes=None)``: the IR after every pass (or only the named ones).
* ``PrintAfterChange(always=None)``: the IR after each pass that changed it (printed text
  and annotations compared: an analysis that only annotates counts), and after the passes
  in ``always`` whether or not they did.
Both take ``show_meta=True`` to print the annotations (fusion groups, phases, hoisting).
* ``DumpIR(dir)``: numbered files ``00_input.ir``, ``01_canonicalize.ir``, ... (each
  pipeline's input, then each pass's output; ``--train`` compiles two pipelines)
* ``PassTiming()``: wall time per pass; ``render()`` gives the table.
* ``Reproducer(dir)``: when a pass fails, writes its input IR with a header holding the
  failing pass and the pass context it ran in (target, options, AMX tiles: what passes
  consult); ``gcomp opt FILE`` (or ``replay(path)``) runs it again in that context.
Verification after every pass is the pass context's ``verify_each`` (on by default).
"""

from __future__ import annotations

import argparse
import glob
import shlex
import sys
import time
from pathlib import Path

from gcomp.errors import GcompError
from gcomp.ir.graph import Graph
from gcomp.ir.parser import parse_graph
from gcomp.ir.printer import print_graph
from gcomp.passes.manager import OPTIONS, Instrument, Pass, PassContext, pass_names

REPRO_HEADER = "# gcomp reproducer: gcomp opt {file} --passes {passes}"


def _known(names, what: str) -> set[str]:
    """``names`` (an iterable, or a comma-separated string) checked against the passes."""
    from gcomp.passes import PASSES
    names = set(pass_names(names))
    unknown = names - set(PASSES)
    if unknown:
        raise GcompError(f"{what}: unknown pass(es) {', '.join(sorted(unknown))}; passes: "
                         f"{', '.join(sorted(PASSES))}")
    return names


class PrintAfter(Instrument):
    def __init__(self, passes: set[str] | str | None = None, stream=None,
                 show_meta: bool = False):
        self.passes = _known(passes, "PrintAfter") if passes else None
        self.stream = stream
        self.show_meta = show_meta

    def run_after_pass(self, p: Pass, graph: Graph, changed: bool) -> None:
        if self.passes is None or p.name in self.passes:
            out = self.stream or sys.stderr
            out.write(f"// ----- IR after {p.name}{'' if changed else ' (unchanged)'} -----\n")
            out.write(print_graph(graph, show_meta=self.show_meta))


class PrintAfterChange(Instrument):
    """``always``: passes printed even when unchanged, so that ``--print-after X
    --print-after-change`` prints X's IR once, not once per instrument."""

    def __init__(self, stream=None, always: set[str] | None = None, show_meta: bool = False):
        self.stream = stream
        self.always = _known(always or (), "PrintAfterChange")
        self.show_meta = show_meta
        self._before: str | None = None

    def run_before_pass(self, p: Pass, graph: Graph) -> None:
        self._before = print_graph(graph, show_meta=True)

    def run_after_pass(self, p: Pass, graph: Graph, changed: bool) -> None:
        text = print_graph(graph, show_meta=True)
        changed = text != self._before
        if changed or p.name in self.always:
            out = self.stream or sys.stderr
            out.write(f"// ----- IR after {p.name} ({'changed' if changed else 'unchanged'})"
                      f" -----\n{text if self.show_meta else print_graph(graph)}")


def _make_dir(directory: str | Path, what: str) -> Path:
    """``directory``, created if missing; a GcompError naming it where that fails (a file
    of that name, no permission), before any pass runs."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GcompError(f"cannot use {str(d)!r} as the {what} directory: "
                         f"{e.strerror or e}") from None
    return d


def read_ir(path: str | Path) -> str:
    """The text of IR file ``path``; a GcompError naming it where it is not readable text."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise GcompError(f"IR file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise GcompError(f"{str(path)!r} is a directory, not an IR file") from None
    except UnicodeDecodeError:
        raise GcompError(f"{str(path)!r} is not IR text (gcomp's printed form; an artifact "
                         f"is inspected with gcomp info)") from None
    except OSError as e:
        raise GcompError(f"cannot read IR file {str(path)!r}: {e.strerror or e}") from None


class DumpIR(Instrument):
    """Numbered IR files: each pipeline's input, then the IR after each pass.  The
    directory must hold no dumps yet: two runs' files would interleave by number, and an
    IR file given to ``gcomp opt`` from there would be written over."""

    def __init__(self, directory: str | Path, prefix: str = ""):
        self.dir = _make_dir(directory, "IR dump")
        self.prefix = prefix
        self.index = 0
        old = sorted(self.dir.glob(f"{glob.escape(prefix)}[0-9][0-9]*_*.ir"))
        if old:
            raise GcompError(f"the IR dump directory {str(self.dir)!r} already holds dumps "
                             f"({old[0].name}, ...); name a new or empty one")

    def _write(self, name: str, graph: Graph) -> None:
        path = self.dir / f"{self.prefix}{self.index:02d}_{name}.ir"
        path.write_text(print_graph(graph, show_meta=True))
        self.index += 1

    def run_before_pipeline(self, pipeline: list[str], graph: Graph) -> None:
        self._write("input", graph)  # the training pipeline starts from the model again

    def run_after_pass(self, p: Pass, graph: Graph, changed: bool) -> None:
        self._write(p.name, graph)


class PassTiming(Instrument):
    def __init__(self):
        self.times: list[tuple[str, float, bool]] = []
        self._t0 = 0.0

    def run_before_pass(self, p: Pass, graph: Graph) -> None:
        self._t0 = time.perf_counter()

    def run_after_pass(self, p: Pass, graph: Graph, changed: bool) -> None:
        self.times.append((p.name, time.perf_counter() - self._t0, changed))

    def render(self) -> str:
        total = sum(t for _, t, _ in self.times) or 1e-12
        rows = [f"{'pass':<24} {'ms':>9} {'%':>6}  changed"]
        for name, t, changed in self.times:
            rows.append(f"{name:<24} {t * 1e3:>9.3f} {100 * t / total:>6.1f}  {'yes' if changed else 'no'}")
        rows.append(f"{'total':<24} {total * 1e3:>9.3f}")
        return "\n".join(rows)


class Reproducer(Instrument):
    """On a pass failure, write the failing pass's input IR, with a header naming the pass
    and the pass context to replay it in (``gcomp opt FILE`` runs that header)."""

    def __init__(self, directory: str | Path):
        self.dir = _make_dir(directory, "reproducer")
        self.path: Path | None = None

    def run_on_failure(self, p: Pass, graph_before: Graph, error: BaseException,
                       pipeline: list[str], ctx: PassContext) -> None:
        path = self.dir / f"repro_{p.name}.ir"
        k = 1
        while path.exists():  # an earlier reproducer, or the file being replayed: kept
            k += 1
            path = self.dir / f"repro_{p.name}_{k}.ir"
        header = " ".join([REPRO_HEADER.format(file=shlex.quote(str(path)), passes=p.name),
                           *context_flags(ctx)])
        msg = str(error).splitlines()[0] if str(error) else type(error).__name__
        try:
            path.write_text(f"{header}\n# pipeline before it: {','.join(pipeline[:-1])}\n"
                            f"# error: {msg}\n{print_graph(graph_before, show_meta=True)}")
        except OSError as e:  # the pass's error, raised next, is what matters: not replaced
            print(f"gcomp: warning: no reproducer written to {str(path)!r}: "
                  f"{e.strerror or e}", file=sys.stderr)
            return
        self.path = path


def parse_pipeline(text: str) -> list[Pass]:
    """``"canonicalize,fuse_aggregate"`` -> pass instances (see ``gcomp.passes.PASSES``)."""
    from gcomp.passes import PASSES
    passes = []
    for name in filter(None, (t.strip() for t in text.split(","))):
        if name not in PASSES:
            raise GcompError(f"unknown pass {name!r}; passes: {', '.join(sorted(PASSES))}")
        passes.append(PASSES[name]())
    return passes


def context_flags(ctx: PassContext) -> list[str]:
    """The ``gcomp opt`` flags that rebuild what passes consult in ``ctx`` (those at their
    defaults left out)."""
    flags = [] if ctx.target == "llvm" else ["-t", ctx.target]
    if ctx.option("prefer") != OPTIONS["prefer"][0]:
        flags += ["--prefer", ctx.option("prefer")]
    if ctx.option("deterministic"):
        flags.append("--deterministic")
    if ctx.tile_products:
        flags.append("--tile-products")
    return flags


class _HeaderParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit
        raise GcompError(message)


def _header(path: Path, text: str, instruments) -> tuple[str, PassContext]:
    """The passes in a reproducer's header, and the pass context it names."""
    first = text.split("\n", 1)[0]
    prefix = REPRO_HEADER.split("{file}")[0]
    if not first.startswith(prefix):
        raise GcompError(f"{path}: no --passes given and no reproducer header")
    p = _HeaderParser(add_help=False)  # the flags context_flags writes, as gcomp opt reads them
    p.add_argument("file")
    p.add_argument("--passes", required=True)
    p.add_argument("-t", "--target", default="llvm")
    p.add_argument("--prefer", default=OPTIONS["prefer"][0], choices=OPTIONS["prefer"])
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--tile-products", action="store_true")
    try:
        a = p.parse_args(shlex.split(first[len(prefix):]))
    except (GcompError, ValueError) as e:
        raise GcompError(f"{path}: malformed reproducer header {first!r}: {e}") from None
    ctx = PassContext(target=a.target, tile_products=a.tile_products, instruments=instruments,
                      options={"prefer": a.prefer, "deterministic": a.deterministic})
    return a.passes, ctx


def replay(path: str | Path, passes: str | None = None, instruments=()):
    """Parse an IR file (e.g. a reproducer) and run ``passes`` on it (default: its header's,
    in the pass context the header names), observed by ``instruments``."""
    from gcomp.passes import PassManager
    text = read_ir(path)
    if passes is None:
        passes, ctx = _header(Path(path), text, instruments)
    else:
        ctx = PassContext(instruments=instruments)
    return PassManager(parse_pipeline(passes))(parse_graph(text), ctx)
