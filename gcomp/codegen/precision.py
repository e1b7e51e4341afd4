"""Storage precision: node-sized activations in bfloat16 (``--precision bf16``).

Expects lowered plans (inference and training) whose buffers are float32, and their
kernel specs.  Guarantees, for ``store_bf16``:

* The float32 node-sized buffers the kernels compute (activations, their gradients, the
  graph-static values computed when features are fed) are stored as bfloat16.  Node
  inputs, model outputs, the loss, parameters, their gradients, optimizer state and edge
  values stay float32: what the caller gives and gets back is float32 as before, and the
  weights are updated in float32.  A computed value whose sparsity picks a kernel
  variant (GraphSAGE's mean of the input features) is measured, and checked by its
  variant's ``match_kernel``, in bfloat16.
* Every kernel touching such a buffer declares that argument bfloat16
  (``spec.p["bf16"]``, ``gcomp/codegen/kernels.py``): it loads it widened to float32,
  computes and sums in float32 and rounds once when it stores.  A kernel that adds into
  its output in memory would round after every term; checked on each kernel's TensorIR,
  such an output (and any argument a kernel's definition cannot declare bfloat16) stays
  float32, until no kernel needs a change.
* On a target with AMX tiles or AVX-512 BF16 dot products, products reading a node
  input that those could run read a bfloat16 copy of it (``{input}.bf16``) that a feed
  step rounds once per feed; not with ``--prefer memory`` (``feature_copies=False``):
  the copy would live as long as the binding, so those products read the float32 input,
  and on AVX-512 BF16 a product ``x @ W`` rounds x's rows as it reads them
  (``round_x``), to the values the copy would have held.
"""

from __future__ import annotations

import re

from gcomp.codegen.dot_bf16_kernels import uses_dot
from gcomp.codegen.kernels import KernelSpec, define, has_amx, has_dot_bf16, param_dtypes
from gcomp.errors import CompileError
from gcomp.runtime.plan import Plan

PRECISIONS = ("fp32", "bf16")


def store_bf16(plans: list, specs: dict, tgt: dict, feature_copies: bool = True) -> None:
    """Store each plan's activations in bfloat16 (in place: plan buffers, steps and
    ``specs``); see the module docstring.  ``feature_copies=False`` (``--prefer memory``)
    keeps the products reading the features float32 instead of giving them a bfloat16
    copy of the features that lives as long as the binding."""
    for plan in plans:
        if plan is not None:
            _store_plan(plan, specs, tgt, feature_copies)


def _store_plan(plan: Plan, specs: dict, tgt: dict, feature_copies: bool) -> None:
    chosen = _candidates(plan)
    steps = [dict(s) for s in plan.bind_steps + plan.feed_steps + plan.steps]
    originals = [(s["kernel"], s.get("formats")) for s in steps]
    names_of: dict[str, list] = {}  # kernel -> its argument names, in order
    variants = [dict(v) for v in plan.variants.values()]
    matches = [v.get("match_kernel") for v in variants]
    kept: dict[str, str] = {}  # buffer kept float32 -> why
    while True:
        demote: dict[str, str] = {}
        for s, (kernel, formats) in zip(steps, originals):
            bufs = _stored_args(plan, s, chosen)
            if kernel not in names_of:
                names_of[kernel] = list(param_dtypes(define(specs[kernel], tgt)))
            names = names_of[kernel]
            stored = {names[i]: b for i, b in bufs.items()}
            s["kernel"] = _retyped(kernel, stored, specs, tgt, demote)
            if formats is not None:
                s["formats"] = {**formats, "kernels": {
                    fmt: _retyped(k, stored, specs, tgt, demote)
                    for fmt, k in formats["kernels"].items()}}
        for v, match in zip(variants, matches):  # it tells whether a variant's values moved
            root = _root(plan, v["input"])
            if match is not None:
                v["match_kernel"] = _retyped(match, {"x": root} if root in chosen else {},
                                             specs, tgt, demote)
        if not demote:
            break
        chosen -= set(demote)
        kept.update(demote)
    for old, new in zip(plan.bind_steps + plan.feed_steps + plan.steps, steps):
        old.update(new)
    for old, new in zip(plan.variants.values(), variants):
        old.update(new)
    for name, b in plan.buffers.items():
        if _root(plan, name) in chosen:
            b["dtype"] = "bfloat16"
    plan.precision = {"bfloat16": sorted(chosen), "kept_float32": dict(sorted(kept.items()))}
    if feature_copies and (has_amx(tgt) or has_dot_bf16(tgt)):
        _round_features(plan, specs, tgt)
    elif has_dot_bf16(tgt):
        _round_as_read(plan, specs, tgt)


def _round_features(plan: Plan, specs: dict, tgt: dict) -> None:
    """Give the products that read a node input (the features: the first layer's x @ W and
    its weight gradient) a bfloat16 copy of it, rounded once per feed by a feed step,
    where that makes them tile or dot products (``amx_kernels.py``,
    ``dot_bf16_kernels.py``): the products then read half the bytes every step (AMD EPYC
    Zen 4, arxiv-size rows, per-kernel medians of GIN's bf16 steps: x @ W 128 -> 32 3.2 ms
    against 3.7 rounding x as read, ``_round_as_read``; x.T @ dY 4.0 against 5.2).  The
    input itself then stays float32 and is read by the feed step alone (in the caller's
    array)."""
    for inp in _float_features(plan):
        x = inp["name"]
        readers = []
        for s in plan.steps:
            spec = specs[s["kernel"]]
            if spec.kind not in ("matmul", "matmul_tn") or s["args"][0].get("buf") != x:
                continue
            p = spec.p
            stored = tuple(sorted(set(p.pop("bf16", ())) | {"x"}))
            tiles = KernelSpec.make(spec.kind, **p, bf16=stored)
            script = define(tiles, tgt).script()
            if "tdpbf16ps" in script or uses_dot(script):
                readers.append((s, tiles))
        if not readers:
            continue
        copy = f"{x}.bf16"
        plan.buffers[copy] = {"dims": list(inp["dims"]), "dtype": "bfloat16"}
        rounding = KernelSpec.make("round_rows", F=int(inp["dims"][1]), bf16=("out",))
        specs[rounding.name] = rounding
        step = {"kernel": rounding.name, "args": [{"buf": x}, {"buf": copy}],
                "node": copy, "op": "round_rows"}
        unless = {s.get("unless") for s, _ in readers}
        if len(unless) == 1 and None not in unless:
            step["unless"] = unless.pop()  # the sparse-feature variant reads x instead
        plan.feed_steps.append(step)
        for s, tiles in readers:
            specs[tiles.name] = tiles
            s["kernel"] = tiles.name
            s["args"] = [{"buf": copy}] + s["args"][1:]
        plan.precision["bfloat16"] = sorted(plan.precision["bfloat16"] + [copy])


def _round_as_read(plan: Plan, specs: dict, tgt: dict) -> None:
    """Where the features have no bfloat16 copy: each product ``x @ W`` of a node input
    that the dot-product kernel can run rounds x's rows as it reads them (``round_x``),
    twice as fast as the float32 product (AMD EPYC Zen 4, arxiv-size rows: 128 -> 32
    6.5 -> 3.4 ms).  Weight gradients ``x.T @ dy`` need nothing: with dy stored as
    bfloat16 they run on dot products already, rounding x as they pack it."""
    inputs = {i["name"] for i in _float_features(plan)}
    for s in plan.steps:
        spec = specs[s["kernel"]]
        if spec.kind != "matmul" or s["args"][0].get("buf") not in inputs:
            continue
        rounding = KernelSpec.make("matmul", **spec.p, round_x=True)
        if uses_dot(define(rounding, tgt).script()):
            specs[rounding.name] = rounding
            s["kernel"] = rounding.name


def _float_features(plan: Plan) -> list[dict]:
    """The plan's float32 node inputs of rows of features ([N, F]): what the first
    layer's products read."""
    return [i for i in plan.inputs if i["role"] == "node"
            and i.get("dtype", "float32") == "float32" and len(i["dims"]) == 2]


def _root(plan: Plan, name: str) -> str:
    return plan.buffers[name].get("alias", name)


def _candidates(plan: Plan) -> set:
    """Root buffers that may be stored as bfloat16."""
    keep = set(plan.params) | set(plan.state) | set(plan.consts) | set(plan.grads.values())
    keep |= {o["buffer"] for o in plan.outputs} | {i["name"] for i in plan.inputs}
    if plan.loss:
        keep.add(plan.loss)
    keep = {_root(plan, k) for k in keep if k in plan.buffers}
    return {n for n, b in plan.buffers.items()
            if "alias" not in b and n not in keep and b["dtype"] == "float32"
            and b["dims"] and b["dims"][0] == "N"}


def _stored_args(plan: Plan, step: dict, chosen: set) -> dict:
    """Argument position -> root buffer, for the step's arguments stored as bfloat16."""
    return {i: _root(plan, a["buf"]) for i, a in enumerate(step["args"])
            if "buf" in a and _root(plan, a["buf"]) in chosen}


def _retyped(kernel: str, stored: dict, specs: dict, tgt: dict, demote: dict) -> str:
    """The kernel with the arguments named in ``stored`` (name -> buffer) in bfloat16;
    the buffers it cannot take so go into ``demote`` (buffer -> why)."""
    if not stored:
        return kernel
    spec = specs[kernel]
    refused = set(stored) - _accepted(spec, frozenset(stored), tgt)
    if refused:
        demote.update({stored[name]: f"{spec.kind} cannot take its {name!r} in bfloat16"
                       for name in refused})
        return kernel
    new = KernelSpec.make(spec.kind, **spec.p, bf16=tuple(sorted(stored)))
    specs[new.name] = new
    return new.name


def _accepted(spec: KernelSpec, names: frozenset, tgt: dict) -> frozenset:
    """The arguments among ``names`` the kernel takes as bfloat16: all, or those added one
    at a time (in name order) while it still does (its definition mixes some of them with
    float32 values it cannot widen, or adds into one)."""
    key = (spec.name, names, str(sorted(tgt.items())))  # the target decides: see _judged
    if key not in _ACCEPTED:
        def takes(sub: frozenset) -> bool:
            try:
                func = _judged(KernelSpec.make(spec.kind, **spec.p, bf16=tuple(sorted(sub))),
                               tgt)
            except CompileError:
                return False
            return not _accumulated(func) & sub
        if takes(names):
            _ACCEPTED[key] = names
        else:
            ok: frozenset = frozenset()
            for name in sorted(names):
                if takes(ok | {name}):
                    ok |= {name}
            _ACCEPTED[key] = ok
    return _ACCEPTED[key]


_ACCEPTED: dict = {}  # (kernel, arguments asked for, target) -> those it takes as bfloat16


def _judged(spec: KernelSpec, tgt: dict):
    """The kernel as the target runs it: the CPU's definition, or on CUDA its GPU form as
    scheduled (where a register of the argument's type holds a sum, ``_accumulated`` sees
    it); a CompileError where it cannot be built so."""
    if tgt["kind"] != "cuda":
        return define(spec, tgt)
    import tvm

    from gcomp.codegen import cuda_build
    from gcomp.schedules.cuda import schedule
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": define(cuda_build.cuda_spec(spec))}))
    try:
        schedule(sch, spec)
    except Exception as e:  # noqa: BLE001 - a schedule refusing the bfloat16 arguments
        raise CompileError(f"{spec.kind} does not schedule with bfloat16 arguments: {e}") \
            from e
    return sch.mod["main"]


def _accumulated(func) -> set:
    """Arguments a kernel both stores into and loads from (from its TensorIR text), or
    stores a bfloat16 constant into (TVM 0.27 cannot lower that store).  A scheduled
    kernel's register copy of an argument (``{name}_local``, of the argument's type)
    counts as the argument: a sum kept there is rounded at every term all the same."""
    params = set(param_dtypes(func))
    names = params | {f"{p}_local" for p in params}
    written, read = set(), set()
    func_lines = func.script().splitlines()
    for k, line in enumerate(func_lines):
        body = line.strip()
        if "llvm.prefetch" in body:  # takes an address (the matmul's output rows): no value
            continue
        if body.startswith("T.writes("):  # a block's declared writes
            written.update(m for m in re.findall(r"\b(\w+)\[", body) if m in names)
            continue
        target = _assigned(body, names)
        if target is not None:
            written.add(target[0])
            body = target[1]
            if "T.bfloat16(" in body and _in_vector_loop(func_lines, k):
                read.add(target[0])  # a constant TVM 0.27 cannot store as a vector
        read.update(m for m in re.findall(r"\b(\w+)\[", body) if m in names)
    return {name.removesuffix("_local") for name in written & read} & params


def _in_vector_loop(lines: list, k: int) -> bool:
    """Whether line ``k`` of a TensorIR text is inside a vectorized loop (by indentation)."""
    depth = len(lines[k]) - len(lines[k].lstrip())
    for line in reversed(lines[:k]):
        d = len(line) - len(line.lstrip())
        if d < depth and line.strip():
            if "T.vectorized(" in line:
                return True
            depth = d
    return False


def _assigned(line: str, names: set):
    """(buffer, right-hand side) of a buffer store ``name[...] = value``, else None."""
    m = re.match(r"(\w+)\[", line)
    if not m or m.group(1) not in names:
        return None
    depth, i = 0, len(m.group(1))
    for i in range(len(m.group(1)), len(line)):
        depth += {"[": 1, "]": -1}.get(line[i], 0)
        if depth == 0:
            break
    rest = line[i + 1:]
    if not rest.startswith(" = "):
        return None
    return m.group(1), line[len(m.group(1)) + 1:i] + " " + rest[3:]
