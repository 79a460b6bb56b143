"""The ops as torch.library custom ops (namespace `tandem`), with fake implementations, for torch.compile.

Every op of the library's table (_optable) gets, generated from it:
- a functional form, `tandem::<op>(inputs..., comm, free dims..., flags and scale...) -> outputs` (outputs allocated
  by the op; gemm_ar(a, b, comm), ag_gemm(a, b, comm, m), ring_attention(q, k, v, comm, causal, scale, layout));
- for each optional output, a functional form that also returns it, `tandem::<op>_<output>` (ring_attention_lse);
- an out form, `tandem::<op>_out(..., outputs...) -> ()`, which mutates its outputs (an op with no outputs, barrier,
  has none, and is marked as having a side effect so it is never removed as dead code).
The GEMM ops (the table's FP8 ops) append to both forms `Tensor? a_scale=None, Tensor? b_scale=None,
int? out_dtype=None, int? scaling=None`: the FP8 scales, c's dtype as a tandem_dtype_t code and the scaling's code,
None for the eager call's defaults (gemm_ar(a, b, comm, layout, a_scale, b_scale, out_dtype, scaling)).
The communicator travels as its integer id (Communicator.id): torch.library schemas take tensors and scalars, not
Python objects. The id carries the rank and the world size, so compiled graphs cached on disk (torch.compile shares
them between a user's processes) never pass from one rank or world size to another with the wrong output shapes.
The fake implementations compute output shapes and dtypes (they run on FakeTensors while tracing), from the table's
extents, the input shapes and, where a shape needs them, the communicator's rank and size; the GEMM ops'
also check what eager calls check with no data (dtypes, ranks, k, the FP8 scales' presence and shapes), so a bad call
fails while tracing. Eager calls skip all of this and go straight to the C ABI (Communicator.<op>); these ops are what
Dynamo puts into a graph, so a compiled function holds every tandem call whole (fullgraph=True).
"""

from __future__ import annotations

import torch

from . import _capi, _comm, _optable
from ._optable import SPECS

_lib = "tandem::"
_DTYPE_OF_CODE = {code: dtype for dtype, code in _comm._DTYPES.items()}


def _c(comm_id: int) -> "_comm.Communicator":
    c = _comm._registry.get(comm_id)
    if c is None:
        raise ValueError(f"tandem: communicator {comm_id} was closed (or never existed in this process)")
    return c


def _scalar_type(f: dict) -> str:
    return "float" if f["kind"] == "scale" else "int" if f["enum"] else "bool"


def _scalar_default_value(f: dict):
    return 0.0 if f["kind"] == "scale" else 0 if f["enum"] else False


def _scalar_default(f: dict) -> str:
    return "0.0" if f["kind"] == "scale" else "0" if f["enum"] else "False"


def _fp8_dtype(name: str, code):
    """out_dtype as the schemas carry it (a tandem_dtype_t code, None: the default) -> the torch dtype the eager
    call takes."""
    return None if code is None else _DTYPE_OF_CODE[_comm._enum_code(code, name, "out_dtype")]


def _register(spec: _optable.Spec) -> None:
    name = spec.name
    ins = [s.name for s in spec.inputs]
    free = [spec.dim_names[i] for i in spec.free_dims]
    scalars = [f["name"] for f in spec.scalars]
    head = ", ".join([f"Tensor {n}" for n in ins] + ["int comm"] + [f"int {n}" for n in free] +
                     [f"{_scalar_type(f)} {f['name']}" for f in spec.scalars])
    n_head = len(ins) + 1 + len(free) + len(scalars)
    # The functional forms give the flags and scale their defaults (0, False, 0.0), so a field the library appends
    # (the GEMM ops' layout) keeps older positional calls valid. (The out forms cannot: their outputs follow.)
    head_defaults = ", ".join([f"Tensor {n}" for n in ins] + ["int comm"] + [f"int {n}" for n in free] +
                              [f"{_scalar_type(f)} {f['name']}={_scalar_default(f)}" for f in spec.scalars])
    # FP8 (the GEMM ops): the scales and the out_dtype and scaling codes, None by default (the eager call's
    # defaults: no scale; out_dtype bf16 for FP8 inputs, a's dtype otherwise; scaling "block" where a scale is 2-D),
    # appended last to both forms so every older call stays valid.
    fp8 = [s.name for s in spec.fp8_scales] + [f["name"] for f in spec.fp8_fields] if spec.fp8 else []
    fp8_tail = "".join([f", Tensor? {s.name}=None" for s in spec.fp8_scales] +
                       [f", int? {f['name']}=None" for f in spec.fp8_fields]) if spec.fp8 else ""

    def split(args, at=n_head):
        """(inputs, comm, free dims, scalars, FP8 arguments) of a call's arguments; the FP8 ones begin at `at`.
        (Arguments left at their defaults may be missing from the end.)"""
        inputs = args[:len(ins)]
        comm = args[len(ins)]
        frees = dict(zip(free, args[len(ins) + 1:len(ins) + 1 + len(free)]))
        scal = {f["name"]: _scalar_default_value(f) for f in spec.scalars}
        scal.update(zip(scalars, args[len(ins) + 1 + len(free):n_head]))
        f8 = dict.fromkeys(fp8)
        f8.update(zip(fp8, args[at:]))
        return inputs, comm, frees, scal, f8

    def out_dtype(inputs, scal, f8):
        """c's dtype (the GEMM ops): the operands and FP8 arguments checked as the eager call checks them, with no
        data and no communicator, so a bad call fails while tracing."""
        a, b = inputs[0], inputs[1]
        _, _, rows, n, k = _comm._gemm_operands(name, a, b, scal.get("layout", 0))
        return _comm._fp8_args(name, a, rows, n, k, *(f8[s.name] for s in spec.fp8_scales),
                               _fp8_dtype(name, f8["out_dtype"]), f8["scaling"])[0]

    def shapes(inputs, comm, frees, scal, f8, slots):
        tensors = dict(zip(ins, inputs))
        lay = scal.get("layout") if spec.transposes else None
        dims, share = spec.bind(tensors, frees, layout=lay)
        cache = {}

        def c():
            if "c" not in cache:
                cache["c"] = _c(comm)
            return cache["c"]

        like = next((t for t, s in zip(inputs, spec.inputs) if s.type == "op_dtype"), None)
        raw = next((t for t, s in zip(inputs, spec.inputs) if s.type == "raw"), None)
        dtype = like.dtype if like is not None else None
        odt = out_dtype(inputs, scal, f8) if spec.fp8 else dtype
        out = []
        for s in slots:
            shape = spec.shape(s, dims, share, lambda: c().rank, lambda: c().world_size, like=raw, layout=lay)
            out.append((shape, raw.dtype if s.type == "raw" else odt if s.type == "out_dtype" else s.dtype(dtype)))
        return out

    def eager(comm, inputs, frees, scal, f8, outs):
        c = _c(comm)
        kw = {**frees, **scal, **{spec.out_name(s): t for s, t in outs.items()}}
        if spec.fp8:
            kw.update(f8, out_dtype=_fp8_dtype(name, f8["out_dtype"]))
        method = getattr(c, "_eager_" + name, None)
        if method is not None:
            method(*inputs, **kw)
        else:
            c._eager_table_op(name, inputs, kw)

    def functional(extra):
        slots = [s for s in spec.outputs if not s.optional] + extra

        def impl(*args):
            inputs, comm, frees, scal, f8 = split(args)
            c = _c(comm)
            outs = {s: c._out(shape, dtype)
                    for s, (shape, dtype) in zip(slots, shapes(inputs, comm, frees, scal, f8, slots))}
            eager(comm, inputs, frees, scal, f8, outs)
            return tuple(outs.values()) if len(outs) > 1 else next(iter(outs.values()), None)

        def fake(*args):
            inputs, comm, frees, scal, f8 = split(args)
            out = [inputs[0].new_empty(shape, dtype=dtype)
                   for shape, dtype in shapes(inputs, comm, frees, scal, f8, slots)]
            return tuple(out) if len(out) > 1 else (out[0] if out else None)

        ret = "()" if not slots else "Tensor" if len(slots) == 1 else "(" + ", ".join(["Tensor"] * len(slots)) + ")"
        op_name = name + "".join("_" + s.name for s in extra)
        op = torch.library.custom_op(_lib + op_name, impl, mutates_args=(),
                                     schema=f"({head_defaults}{fp8_tail}) -> {ret}")
        op.register_fake(fake)
        if not slots:
            torch.fx.node.has_side_effect(getattr(torch.ops.tandem, op_name).default)

    functional([])
    for s in spec.outputs:
        if s.optional:
            functional([s])
    if not spec.outputs:
        return

    outs = spec.outputs
    alias = "abcdefghijklmnopqrstuvwxyz"
    tail = ", ".join(f"Tensor({alias[i]}!){'?' if s.optional else ''} {spec.out_name(s)}" for i, s in enumerate(outs))

    def out_impl(*args):
        inputs, comm, frees, scal, f8 = split(args, n_head + len(outs))
        eager(comm, inputs, frees, scal, f8, {s: t for s, t in zip(outs, args[n_head:]) if t is not None})

    def out_fake(*args):
        if spec.fp8:  # the checks, and the outputs' dtypes, while tracing (shapes: when the op runs)
            inputs, comm, frees, scal, f8 = split(args, n_head + len(outs))
            odt = out_dtype(inputs, scal, f8)
            for s, t in zip(outs, args[n_head:]):
                if t is not None:
                    _comm._check_meta(t, spec.out_name(s), name, odt if s.type == "out_dtype" else
                                      s.dtype(inputs[0].dtype))
        return None

    op = torch.library.custom_op(_lib + name + "_out", out_impl, mutates_args=tuple(spec.out_name(s) for s in outs),
                                 schema=f"({head}, {tail}{fp8_tail}) -> ()")
    op.register_fake(out_fake)


for _spec in SPECS.values():
    _register(_spec)
del _spec


def _fp8_args(spec: _optable.Spec, a, kw: dict) -> tuple[list, torch.dtype]:
    """A GEMM op's FP8 keywords (popped from kw) as its schema takes them: the scales, then out_dtype's and scaling's
    codes (None where not given); and c's dtype. out_dtype and scaling are checked here, while tracing."""
    scales = [kw.pop(s.name, None) for s in spec.fp8_scales]
    out_dtype, scaling = kw.pop("out_dtype", None), kw.pop("scaling", None)
    odt = _comm._fp8_out_dtype(spec.name, a, out_dtype)
    return [*scales, None if out_dtype is None else _comm._DTYPES[odt],
            None if scaling is None else _comm._enum_code(scaling, spec.name, "scaling")], odt


def call(name: str, comm, *inputs, **kw):
    """Any op of the table under torch.compile, with the keywords of its Communicator method: outputs (`out`, then
    the others by name), `return_<optional output>`, free dims, flags and scale, and the GEMM ops' FP8 keywords
    (a_scale, b_scale, out_dtype, scaling)."""
    spec = SPECS[name]
    for s in spec.opt_inputs:
        if kw.pop(s.name, None) is not None:
            raise TypeError(f"tandem.{name}: argument '{s.name}' is taken by eager calls only, not under "
                            "torch.compile (tandem.nn.MoE(save_activations=True) compiles with it)")
    like = next((t for t, s in zip(inputs, spec.inputs) if s.type == "op_dtype"), None)
    fp8, odt = _fp8_args(spec, like, kw) if spec.fp8 else ([], None)
    outs = {s: kw.pop(spec.out_name(s), None) for s in spec.outputs}
    want = [s for s in spec.outputs if s.optional and (kw.pop("return_" + s.name, False) or outs[s] is not None)]
    frees = {spec.dim_names[i]: kw.pop(spec.dim_names[i], None) for i in spec.free_dims}
    scal = {f["name"]: kw.pop(f["name"], None) for f in spec.scalars}
    if kw:
        raise TypeError(f"tandem.{name}: unexpected keyword argument(s) {', '.join(sorted(kw))}")
    for f in spec.scalars:  # names to codes first: the layout decides how the tensors' axes read
        v = scal[f["name"]]
        scal[f["name"]] = (0.0 if v is None else float(v) if f["kind"] == "scale" else
                           _comm._enum_code(0 if v is None else v, name, f["name"]) if f["enum"] else bool(v))
    lay = scal.get("layout") if spec.transposes else None
    tensors = {s.name: t for s, t in zip(spec.inputs, inputs)}
    tensors.update({s.name: t for s, t in outs.items() if t is not None})
    dims, _ = spec.bind(tensors, frees, nranks=lambda: comm.world_size, layout=lay)
    for i in spec.free_dims:
        if i not in dims:
            dims[i] = spec.default_dim(i, tensors, dims, comm.world_size, layout=lay)
    args = [*inputs, comm.id, *(dims[i] for i in spec.free_dims), *(scal[f["name"]] for f in spec.scalars)]
    ops = torch.ops.tandem
    if all(t is None for t in outs.values()):
        return getattr(ops, name + "".join("_" + s.name for s in want))(*args, *fp8)
    dims_, share = spec.bind(tensors, {spec.dim_names[i]: dims[i] for i in spec.free_dims}, layout=lay)
    raw = next((t for t, s in zip(inputs, spec.inputs) if s.type == "raw"), None)
    for s in spec.outputs:
        if outs[s] is None and (not s.optional or s in want):
            shape = spec.shape(s, dims_, share, lambda: comm.rank, lambda: comm.world_size, like=raw, layout=lay)
            outs[s] = (raw if s.type == "raw" else like).new_empty(
                shape, dtype=raw.dtype if s.type == "raw" else odt if s.type == "out_dtype" and odt is not None
                else s.dtype(like.dtype))
    getattr(ops, name + "_out")(*args, *outs.values(), *fp8)
    ret = [outs[s] for s in spec.outputs if not s.optional or s in want]
    return tuple(ret) if len(ret) > 1 else (ret[0] if ret else None)


# ---- the public functions under torch.compile, with each op's own keywords (Communicator.<op> calls them)
def ag_gemm(comm, a, b, *, out=None, m=None, a_gathered=None, layout="nt", a_scale=None, b_scale=None,
            out_dtype=None, scaling=None):
    lay = _comm._enum_code(layout, "ag_gemm")
    spec = SPECS["ag_gemm"]
    fp8, odt = _fp8_args(spec, a, dict(a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype, scaling=scaling))
    if m is None:
        m = out.shape[0] if out is not None else \
            a.shape[1 if spec.transposed(spec.inputs[0], lay) else 0] * comm.world_size
    if out is None and a_gathered is None:
        return torch.ops.tandem.ag_gemm(a, b, comm.id, m, lay, *fp8)
    if out is None:
        out = a.new_empty((m, b.shape[1 if spec.transposed(spec.inputs[1], lay) else 0]), dtype=odt)
    torch.ops.tandem.ag_gemm_out(a, b, comm.id, m, lay, out, a_gathered, *fp8)
    return out


def gemm_rs(comm, a, b, *, out=None, layout="nt", a_scale=None, b_scale=None, out_dtype=None, scaling=None):
    return call("gemm_rs", comm, a, b, out=out, layout=layout, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
                scaling=scaling)


def gemm_ar(comm, a, b, *, out=None, layout="nt", a_scale=None, b_scale=None, out_dtype=None, scaling=None):
    return call("gemm_ar", comm, a, b, out=out, layout=layout, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
                scaling=scaling)


def moe_dispatch_gemm(comm, x, topk_ids, topk_weights, w, *, capacity=None, out=None, row_info=None,
                      expert_counts=None):
    return call("moe_dispatch_gemm", comm, x, topk_ids, topk_weights, w, capacity=capacity, out=out,
                row_info=row_info, expert_counts=expert_counts)


def moe_ffn(comm, x, topk_ids, topk_weights, w1, w2, *, out=None, saved=None):
    return call("moe_ffn", comm, x, topk_ids, topk_weights, w1, w2, out=out, saved=saved)


def ring_attention(comm, q, k, v, *, causal=False, scale=None, out=None, lse=None, return_lse=False,
                   layout="contiguous"):
    return call("ring_attention", comm, q, k, v, causal=causal, scale=scale, out=out, lse=lse, return_lse=return_lse,
                layout=layout)


def allgather(comm, x, *, out=None):
    return call("allgather", comm, x, out=out)


def barrier(comm):
    return call("barrier", comm)
