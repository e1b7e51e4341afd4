"""Code generation structure: index widths, no per-edge feature buffers, the compile cache."""

import pytest

import gcomp.models as models
from gcomp.codegen.build import build_library, make_target
from gcomp.codegen.kernels import KernelSpec, define
from gcomp.codegen.lower import lower
from gcomp.passes import default_pipeline


def test_edge_offsets_are_64_bit():
    """Graphs with nnz >= 2^31 need 64-bit row offsets and edge loop counters."""
    import re

    spec = KernelSpec.make("csr_agg", reduce="sum", H=1, C=16, weight="edge")
    for target in (None, "llvm"):
        text = define(spec, target).script()
        assert re.search(r'indptr: T.Buffer\(\("n \+ T.int64\(1\)",\), "int64"', text), text
        assert re.search(r'indices: T.Buffer\(\(nnz,\), "int32"', text)  # node ids: N < 2^31
        # the edge loop runs between int64 offsets, so its counter is int64 too
        assert re.search(r"for j in range\(indptr\[(.+?)\], indptr\[\1\] \+ \(indptr\[\1 \+ "
                         r"T.int64\(1\)\] - indptr\[\1\]\)\)", text), text


@pytest.mark.parametrize("name", ["gcn", "sage", "gin"])
def test_no_per_edge_feature_buffer(name):
    m = models.build(name, 32, hidden=16, out_channels=4, layers=3)
    plan, _ = lower(default_pipeline()(m.graph.copy()))
    for buf, b in plan.buffers.items():
        if b["dims"] and str(b["dims"][0]).startswith("E:"):
            assert b["dims"][1:] in ([], [1]), (buf, b)  # edge scalars (norms) only


def test_gat_keeps_only_per_head_edge_scores():
    m = models.build("gat", 32, hidden=16, out_channels=4, layers=2, heads=4)
    plan, _ = lower(default_pipeline()(m.graph.copy()))
    widths = {tuple(b["dims"][1:]) for b in plan.buffers.values()
              if b["dims"] and str(b["dims"][0]).startswith("E:")}
    assert widths <= {(4,), (1,), ()}, widths


def test_compile_cache_reuses_libraries():
    m = models.build("gcn", 8, hidden=4, out_channels=2)
    plan, specs = lower(default_pipeline()(m.graph.copy()))
    p1 = build_library(specs, make_target("llvm"))
    mtime = p1.stat().st_mtime_ns
    p2 = build_library(specs, make_target("llvm"))
    assert p1 == p2 and p2.stat().st_mtime_ns == mtime
    other = build_library(specs, make_target("llvm", mcpu="x86-64"))
    assert other != p1


def test_kernel_kind_reads_the_symbol_a_spec_names():
    """``plan.kernel_kind`` (the runtime's reading of a kernel's kind: gcomp info and
    explain) inverts ``KernelSpec.name``, kinds with underscores included."""
    from gcomp.runtime.plan import kernel_kind
    for kind in ("csr_agg", "csr_scatter", "matmul", "matmul_tn", "cross_entropy_grad"):
        assert kernel_kind(KernelSpec.make(kind, F=3, split=True).name) == kind


def test_aggregations_stream_only_what_products_read():
    """``stream_out`` (writing past the caches) marks the CPU aggregations whose output
    only products read, in row order: all four of GraphSAGE's training step; of GCN's,
    the two products read, not the two whose rows an aggregation gathers next; a CUDA
    plan has none."""
    from gcomp.passes import training_pipeline
    from gcomp.runtime.plan import kernel_kind

    def aggregations(name, gpu=False):
        g = training_pipeline()(models.build(name, 128, hidden=32, out_channels=40,
                                             layers=3).graph.copy())
        plan, specs = lower(g, gpu=gpu)
        assert set(plan.kernels()) == set(specs)  # no kernel left without a step
        root = {b: d.get("alias", b) for b, d in plan.buffers.items()}
        readers = {}
        for s in plan.feed_steps + plan.steps:
            for a in s["args"][:-1]:
                if "buf" in a:
                    readers.setdefault(root[a["buf"]], set()).add(kernel_kind(s["kernel"]))
        return [(bool(specs[s["kernel"]].p.get("stream_out")),
                 readers.get(root[s["args"][-1]["buf"]], set()), s.get("when"))
                for s in plan.steps if kernel_kind(s["kernel"]) == "csr_agg"]

    def dense(rows):  # the steps of dense features (not a sparse-feature variant)
        return [(streamed, kinds) for streamed, kinds, when in rows if when is None]

    assert [s for s, _ in dense(aggregations("sage"))] == [True] * 4
    gcn = dense(aggregations("gcn"))
    assert [s for s, _ in gcn] == [False, True, False, True]
    for streamed, kinds in gcn:
        assert streamed == (kinds <= {"matmul", "matmul_tn"})
    assert gcn[0][1] == {"csr_agg"}  # gathered by the next layer's aggregation
    assert not any(s for s, _, _ in aggregations("gcn", gpu=True))
