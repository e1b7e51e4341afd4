"""Elide broadcasts that the elementwise op reading them would do by itself.

Expects: a verified graph (typically right after autodiff, whose gradient of a
sum over an axis is ``broadcast_to(reshape(dy), x)``).
Guarantees: same values; a binary elementwise op reading ``broadcast_to(a, like)``
reads ``a`` instead when numpy broadcasting with its other operand already gives
the op's result shape; a broadcast nothing reads any more is removed.  The op then
reads the small tensor per element instead of a materialized copy the size of its
result, and the broadcast no longer blocks fusion (it had a user per consumer).

    Before:  %b = broadcast_to(%ds, %h)  : f32[N,4,32]     (%ds : f32[N,4,1])
             %m = mul(%b, %att)          : f32[N,4,32]     (%att : f32[4,32])
    After:   %m = mul(%ds, %att)         : f32[N,4,32]
"""

from __future__ import annotations

from gcomp.ir.ops import Op, OpGroup, broadcast_shapes
from gcomp.passes.manager import Pass

# bias_add keeps its own form (a rank-1 bias over the last axis): fusion matches it
BROADCASTING = OpGroup.Binary - {Op.BIAS_ADD}


def _same_shape(a: tuple, b: tuple, want: tuple) -> bool:
    try:
        return tuple(broadcast_shapes(tuple(a), tuple(b))) == tuple(want)
    except ValueError:
        return False


class ElideBroadcasts(Pass):
    name = "elide_broadcasts"

    def run(self, graph, ctx) -> bool:
        elided = []
        for n in graph:
            if n.op not in BROADCASTING:
                continue
            for k in (0, 1):
                b, other = n.inputs[k], n.inputs[1 - k]
                if b.op != Op.BROADCAST_TO or b is other:
                    continue
                src = b.inputs[0]
                if src.ty.dtype == b.ty.dtype and _same_shape(src.ty.shape, other.ty.shape,
                                                              n.ty.shape):
                    n.replace_input(b, src)
                    elided.append(b)
        for b in dict.fromkeys(elided):
            if not b.users and b not in graph.outputs:
                graph.erase_node(b)
        return bool(elided)
