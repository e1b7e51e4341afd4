"""Output rows written with non-temporal (streaming) stores, past the caches.

An aggregation writes each output row once, and the kernel after it (a product) reads the
rows in order, which the hardware prefetcher hides.  Stored through the caches, the rows
(10.8 MB at 32 bfloat16 features on an arxiv-size graph) push out of the last-level
cache the source rows the aggregation gathers again and again, and every line written is
first read from memory (write-allocate).  ``vmovntps`` writes a whole 64-byte line to
memory without reading it and without caching it.

TVM has no non-temporal store, so a kernel imports ``STREAM_LL`` (TVM's
``pragma_import_llvm``, inside ``importing``) and calls its functions by name on the
addresses of an output row and of the float32 scratch row holding its values; they are
always inlined.  The store is inline assembly: LLVM's ``!nontemporal`` store of a
bfloat16 vector became an ordinary ``vmovaps`` (LLVM folds the bitcast into the store and
has no non-temporal pattern for bfloat16 vectors), and one form serves both dtypes.
``vmovntps`` faults on an address that does not start a cache line, so a row that does
not (an output that is a view into a caller's array) is stored plainly: a branch the
predictor learns.  Streaming stores are weakly ordered: each thread's share of rows ends
with ``fence`` (``sfence``), so that what reads them next sees them, as after a
``memcpy``'s streaming loop.  AVX-512 only (``cpu_kernels.AGG_STREAM_TUNINGS``); the
bfloat16 form rounds with ``vcvtneps2bf16`` (AVX-512 BF16), as
``dot_bf16_kernels.store_rounded`` does, to the same bits.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from gcomp.codegen.kernels import importing_llvm

STREAM = "gcomp_stream_line"
_LINE = """
define linkonce_odr void @{name}(ptr %dst, ptr %src) alwaysinline {{
entry:
{load}  %address = ptrtoint ptr %dst to i64
  %offset = and i64 %address, 63
  %on_line = icmp eq i64 %offset, 0
  br i1 %on_line, label %stream, label %plain
stream:
  call void asm sideeffect "vmovntps $1, $0", "=*m,v"(ptr elementtype(<16 x float>) %dst, <16 x float> %line)
  ret void
plain:
  store <16 x float> %line, ptr %dst, align 4
  ret void
}}
"""
STREAM_LL = _LINE.format(name=STREAM + "_float32", load=(
    "  %line = load <16 x float>, ptr %src, align 4\n")) + _LINE.format(
    name=STREAM + "_bfloat16", load=(
        "  %v = load <32 x float>, ptr %src, align 4\n"
        "  %b = fptrunc <32 x float> %v to <32 x bfloat>\n"
        "  %line = bitcast <32 x bfloat> %b to <16 x float>\n")) + f"""
define linkonce_odr void @{STREAM}_fence() alwaysinline {{
  call void asm sideeffect "sfence", "~{{memory}}"()
  ret void
}}
"""


def per_line(bf16: bool) -> int:
    """Values of a row in one 64-byte line."""
    return 32 if bf16 else 16


def streams(F: int, bf16: bool) -> bool:
    """Whether rows of ``F`` values are whole lines (then every row of a buffer on a
    line starts one)."""
    return F > 0 and F % per_line(bf16) == 0


def importing(active: bool = True):
    """The body it wraps may call ``store_row`` (nothing imported when not ``active``)."""
    return importing_llvm(STREAM_LL if active else "")


def store_row(out, i, row, F: int, value, bf16: bool) -> None:
    """out[i, c] = value(c) for c < F (``streams(F, bf16)``): the values computed into
    ``row`` (a float32 scratch of F), then stored a line at a time, rounded to bfloat16
    first when ``bf16``; inside ``importing``."""
    from gcomp.codegen.cpu_kernels import _features  # that module imports this one
    _features(F, lambda c: T.buffer_store(row, value(c), [c]))
    raw = T.decl_buffer(out.shape, "uint16" if bf16 else "float32", data=out.data)
    step = per_line(bf16)
    with T.serial(0, F // step) as k:
        T.evaluate(tirx.call_extern("void", f"{STREAM}_{'bfloat16' if bf16 else 'float32'}",
                                    tirx.address_of(raw[i, k * step]),
                                    tirx.address_of(row[k * step])))


def fence() -> None:
    """Order this thread's streaming stores before what follows (inside ``importing``)."""
    T.evaluate(tirx.call_extern("void", f"{STREAM}_fence"))
