"""Pass infrastructure: passes, the pass context, instruments, the pass manager.

A pass is a class with a ``name`` and ``run(graph, ctx) -> bool`` that edits
the graph in place and says whether it changed anything (fx's
``PassResult.modified``).  A ``PassContext`` carries what passes may consult
(target, graph statistics) and the instruments that observe the pipeline
(TVM's ``PassInstrument`` hooks: ``should_run``, ``run_before_pass``,
``run_after_pass``, plus ``run_on_failure``).  When a pass raises, the error
names the pass and every pass that ran before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from gcomp.errors import GcompError
from gcomp.ir.graph import Graph
from gcomp.ir.verifier import verify


class Pass:
    """Base class; subclasses set ``name`` and implement ``run``."""

    name = "pass"

    def run(self, graph: Graph, ctx: "PassContext") -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Instrument:
    """Observes a pipeline; every hook is optional."""

    def should_run(self, pass_: Pass, graph: Graph) -> bool:
        return True

    def run_before_pipeline(self, pipeline: list[str], graph: Graph) -> None:
        pass

    def run_before_pass(self, pass_: Pass, graph: Graph) -> None:
        pass

    def run_after_pass(self, pass_: Pass, graph: Graph, changed: bool) -> None:
        pass

    def run_on_failure(self, pass_: Pass, graph_before: Graph, error: BaseException,
                       pipeline: list[str], ctx: "PassContext") -> None:
        pass


# options a pass context may carry, and their values (the first is the default)
OPTIONS = {
    # what reorder_linear gives up a wide [N, K] buffer for: "speed" keeps aggregations of
    # fed values (the input features) wide, once per feed; "memory" aggregates them at the
    # narrow width every step and keeps no such buffer; "memory" also leaves the CPU
    # training step's loss rows out (codegen/loss_rows.py: they copy the features),
    # recomputes hidden aggregations and products of the features in the backward pass
    # (rematerialize) and gives bf16 builds no bfloat16 copy of the features
    "prefer": ("speed", "memory"),
    # True: no kernel may make its result depend on the GPU's order of atomic adds; False
    # lets "prefer": "memory" on CUDA scatter the backward aggregations with atomics
    # (no transposed graph on the device; codegen/lower.py), which is not bit for bit
    # reproducible
    "deterministic": (False, True),
}


@dataclass
class PassContext:
    target: str = "llvm"
    instruments: Sequence[Instrument] = ()
    disabled: frozenset = frozenset()
    verify_each: bool = True
    options: dict = field(default_factory=dict)  # see OPTIONS
    # bfloat16 products run on AMX tiles (``--precision bf16`` on a CPU that has them)
    tile_products: bool = False

    def __post_init__(self):
        # one instrument, or one pass name (several comma-separated), as the CLI takes them
        if isinstance(self.instruments, Instrument):
            self.instruments = (self.instruments,)
        bad = [i for i in self.instruments if not isinstance(i, Instrument)]
        if bad:
            raise GcompError(f"instruments must be Instrument objects, not {bad[0]!r}")
        self.disabled = frozenset(pass_names(self.disabled))
        for key, value in self.options.items():
            if key not in OPTIONS:
                raise GcompError(f"unknown pass option {key!r}; options: "
                                 f"{', '.join(sorted(OPTIONS))}")
            if value not in OPTIONS[key]:
                raise GcompError(f"pass option {key!r} takes "
                                 f"{' or '.join(map(repr, OPTIONS[key]))}, not {value!r}")

    def option(self, key: str):
        return self.options.get(key, OPTIONS[key][0])

    def scatters_out_edges(self) -> bool:
        """Whether aggregations over out-edges (the backward ones) scatter with atomic
        adds instead of gathering over the transposed graph: on CUDA with
        ``prefer=memory``, unless ``deterministic`` keeps the gathers.  The compiler
        lowers them so and ``fuse_epilogues`` fuses what they can take by it."""
        return (self.target == "cuda" and self.option("prefer") == "memory"
                and not self.option("deterministic"))


class PassError(GcompError):
    """A pass failed; the message names it and the passes before it."""


def pass_names(names) -> list[str]:
    """Pass names from an iterable of names or a string of comma-separated ones."""
    if isinstance(names, str):
        names = names.split(",")
    return [n.strip() for n in names if n.strip()]


class PassManager:
    """Runs passes in order; a pass may be named more than once (canonicalize again after
    a fusion)."""

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)

    @property
    def pipeline(self) -> list[str]:
        return [p.name for p in self.passes]

    def __call__(self, graph: Graph, ctx: PassContext | None = None) -> Graph:
        ctx = ctx or PassContext()
        from gcomp.passes import PASSES  # the registry of every pass, by name
        known = set(PASSES) | set(self.pipeline)
        unknown = set(ctx.disabled) - known
        if unknown:
            raise GcompError(f"cannot disable unknown pass(es) {', '.join(sorted(unknown))}; "
                             f"passes: {', '.join(sorted(known))}")
        ran: list[str] = []
        for i in ctx.instruments:
            i.run_before_pipeline(self.pipeline, graph)
        for p in self.passes:
            if p.name in ctx.disabled or not all(i.should_run(p, graph) for i in ctx.instruments):
                continue
            for i in ctx.instruments:
                i.run_before_pass(p, graph)
            before = graph.copy()
            try:
                changed = bool(p.run(graph, ctx))
                if ctx.verify_each:
                    verify(graph)
            except Exception as e:  # noqa: BLE001 - reported with the pipeline, then re-raised
                for i in ctx.instruments:
                    i.run_on_failure(p, before, e, ran + [p.name], ctx)
                prior = ", ".join(ran) or "none"
                msg = f"pass {p.name!r} failed: {e}\n(passes that ran before it: {prior})"
                if isinstance(e, GcompError) and not isinstance(e, PassError):
                    raise type(e)(msg) from e
                raise PassError(msg) from e
            ran.append(p.name)
            for i in ctx.instruments:
                i.run_after_pass(p, graph, changed)
        return graph
