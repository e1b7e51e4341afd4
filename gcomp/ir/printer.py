"""Deterministic text form of the Graph IR; ``gcomp.ir.parser`` reads it back.

    graph gcn(%x: f32[N,1433], %g: graph<coo>) {
      %w0 = param[init="glorot"] : f32[1433,16]
      %h = matmul(%x, %w0) : f32[N,16]
      return %h
    }

Attributes print as ``key=<JSON>`` in the op's declared order, leaving out those
at their default value, so equal graphs print equal text and printed text can
serve as a test fixture.  With ``show_meta`` the passes' annotations follow as
``#: <JSON>`` (a node's), ``#: graph <JSON>`` and ``#: %input <JSON>`` (the graph's and
its inputs', after the header), which the parser reads back: an IR dump or a reproducer
replays in the state its pass saw (fusion groups, phases, hoisting, the gradient map).
"""

from __future__ import annotations

import json

from gcomp.ir.ops import OPS, Op


def format_attrs(attrs: dict, op: Op | None = None) -> str:
    """``[k=v, ...]``; attributes at their default value are left out (the parser fills them)."""
    spec = OPS[op].attrs if op is not None else {}
    shown = {k: v for k, v in attrs.items()
             if not (k in spec and not spec[k].required and v == spec[k].default
                     and type(v) is type(spec[k].default))}
    if not shown:
        return ""
    return "[" + ", ".join(f"{k}={json.dumps(v)}" for k, v in shown.items()) + "]"


def format_node(n, show_meta: bool = False) -> str:
    args = ", ".join(f"%{i.name}" for i in n.inputs)
    text = f"%{n.name} = {n.op.value}{format_attrs(n.attrs, n.op)}"
    if n.inputs:
        text += f"({args})"
    text += f" : {n.ty}"
    if show_meta and n.meta:
        text += "  #: " + json.dumps(n.meta, sort_keys=True)
    return text


def print_graph(g, show_meta: bool = False) -> str:
    sig = ", ".join(f"%{n.name}: {n.ty}" for n in g.inputs)
    lines = [f"graph {g.name}({sig}) {{"]
    if show_meta:
        if g.meta:
            lines.append("  #: graph " + json.dumps(g.meta, sort_keys=True))
        lines += [f"  #: %{n.name} " + json.dumps(n.meta, sort_keys=True)
                  for n in g.inputs if n.meta]
    for n in g:
        if n.op != Op.INPUT:
            lines.append("  " + format_node(n, show_meta))
    lines.append("  return " + ", ".join(f"%{o.name}" for o in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"
