"""The ops as libtandem describes them (tandem_op_table, _capi.OPS), read for the paths that work for any op: the
torch.library custom ops and their fake implementations, and the eager path, methods and functions of an op that has
no hand-written one. An op the library gains appears through here with no edit to this package.

How a tensor's shape follows from the table: each slot's extent is a product of terms (a dim, this rank's rows of a
sharded dim, a dim's per-rank share, the rank count, a constant), grouped into axes. Dims are read off the input
tensors' axes where an axis is one dim (or a dim's per-rank share, or a constant times a dim); the rest (ag_gemm's m,
moe_dispatch_gemm's capacity) are passed as integers.

GEMM operand slots (the table's "operand": "a" or "b") are stored transposed under some values of the op's layout
field: the slot's two axes swap (`shape_transposed` is its text then). Which layouts transpose which operand follows
from the layout names themselves: a name's first letter is op(A)'s, its second op(B)'s, and an operand is stored
transposed where its letter differs from the default layout's (code 0, "nt": a [m, k], b [n, k]).
"""

from __future__ import annotations

import torch

from . import _capi
from ._capi import OPS

_FIXED_DTYPES = {"i32": torch.int32, "f32": torch.float32}


def rows_of(m: int, rank: int, nranks: int) -> tuple[int, int]:
    """The balanced row split every sharded op uses (tandem.h): (first row, row count) of `rank`."""
    base, extra = divmod(m, nranks)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class Slot:
    def __init__(self, s: dict, index: int):
        self.name, self.index = s["name"], index
        self.type, self.output, self.optional, self.shape_text = s["type"], s["output"], s["optional"], s["shape"]
        self.operand: str = s.get("operand", "")
        # An FP8 scale (a_scale, b_scale of the GEMM ops): one fp32 per tensor, or the block shape of its terms.
        self.fp8_scale: bool = s.get("fp8_scale", False)
        self.shape_transposed: str = s.get("shape_transposed", "")
        terms = s["terms"]
        self.axes: list[list[dict]] = []
        at = 0
        for n in s["axes"]:
            self.axes.append(terms[at:at + n])
            at += n

    def dtype(self, op_dtype):
        return _FIXED_DTYPES.get(self.type, op_dtype)


class Spec:
    """One op of the table, with what its generic paths need."""

    def __init__(self, op: dict):
        self.op = op
        self.name: str = op["py_name"]
        self.dim_names: list[str] = [d["name"] for d in op["dims"]]
        self.slots = [Slot(s, i) for i, s in enumerate(op["slots"])]
        # FP8 inputs (the GEMM ops): the scales (fp8_scale slots) and the out_dtype and scaling fields are keywords;
        # the torch.library ops append them to their schemas, after what older calls pass by position (_ops).
        self.fp8: bool = op.get("fp8", False)
        # The MoE ops' FP8 weights: w_dtype and the weights' block scales, keywords of the eager paths only (the
        # torch.library ops' schemas leave them out).
        self.fp8_weights: bool = op.get("fp8_weights", False)
        self.fp8_scales = [s for s in self.slots if s.fp8_scale]
        self.inputs = [s for s in self.slots if not s.output and not s.fp8_scale and not s.optional]
        # Optional inputs (moe_ffn_backward's saved): keywords of the eager path; the torch.library ops leave them out.
        self.opt_inputs = [s for s in self.slots if not s.output and not s.fp8_scale and s.optional]
        self.outputs = [s for s in self.slots if s.output]
        self.raw = any(s.type == "raw" for s in self.slots)
        self.fields: list[dict] = op["fields"]
        fp8_fields = ("out_dtype", "scaling") if self.fp8 else ("w_dtype",) if self.fp8_weights else ()
        self.scalars = [f for f in self.fields if f["kind"] in ("flag", "scale") and f["name"] not in fp8_fields]
        self.fp8_fields = [f for f in self.fields if f["name"] in fp8_fields] if self.fp8 else []
        # The GEMM layout: the enum field named "layout" of an op with operand slots, and per code the operands it
        # stores transposed.
        self.enums: dict = _capi.ENUMS.get(self.name, {})
        self.transposes: dict[int, frozenset] = {}
        if any(s.operand for s in self.slots) and "layout" in self.enums:
            names = {code: name for name, code in self.enums["layout"].items()}
            base = names.get(0, "")
            for code, name in names.items():
                self.transposes[code] = frozenset(op_ for i, op_ in enumerate("ab")
                                                  if i < len(name) and i < len(base) and name[i] != base[i])
        bound = set()
        for s in self.inputs:
            for axis in s.axes:
                d = _binds(axis)
                if d is not None:
                    bound.add(d[0])
        if self.raw:  # a raw op's byte count is its input's size
            bound.update(i for i, d in enumerate(op["dims"]) if d["name"] == "bytes")
        free = [i for i in range(len(self.dim_names)) if i not in bound]
        # A per-rank row count that may be 0 and that no required input gives (the MoE FFN ops' saved_rows): the rows of
        # the optional tensor it sizes, 0 without it; not a parameter of its own.
        self.opt_dims = [i for i in free if op["dims"][i]["may_be_zero"] and op["dims"][i]["split"] == "per_rank"]
        # Dims no input gives, passed as integers (in dim order), with the input axis that sets their default.
        self.free_dims = [i for i in free if i not in self.opt_dims]

    def out_name(self, slot: Slot) -> str:
        """The Python keyword of an output: the first output is `out`, the others keep the table's name."""
        return "out" if slot is self.outputs[0] else slot.name

    def transposed(self, slot: Slot, layout: int | None) -> bool:
        """Whether `slot` is stored with its two axes swapped under the layout code (None: the default)."""
        return bool(layout) and slot.operand in self.transposes.get(layout, ())

    def axes_of(self, slot: Slot, layout: int | None) -> list:
        return slot.axes[::-1] if self.transposed(slot, layout) else slot.axes

    def text_of(self, slot: Slot, layout: int | None) -> str:
        """The slot's shape as the table words it, under the layout."""
        return slot.shape_transposed if self.transposed(slot, layout) else slot.shape_text

    def bind(self, tensors: dict, free: dict, nranks=None, layout: int | None = None) -> tuple[dict, dict]:
        """Dims from the tensors given (by slot name; inputs and any outputs) and the free dims' values (by name):
        (dims by index, per-rank shares by index). `nranks` is a callable, asked only where a share needs it.
        `layout`: the op's layout code (operand slots' axes swap where it stores them transposed)."""
        dims: dict[int, int] = {}
        share: dict[int, int] = {}
        for i in self.free_dims:
            v = free.get(self.dim_names[i])
            if v is not None:
                dims[i] = int(v)
        for s in self.slots:
            t = tensors.get(s.name)
            if t is None:
                continue
            if s.type == "raw":
                if not s.output:
                    dims[self.dim_names.index("bytes")] = t.nbytes
                continue
            if t.dim() != len(s.axes):
                continue
            for axis, n in zip(self.axes_of(s, layout), t.shape):
                d = _binds(axis)
                if d is None:
                    continue
                i, how, c = d
                if how == "dim" and i not in dims:
                    dims[i] = int(n) // c
                elif how == "per_rank" and i not in share:
                    share[i] = int(n)
        for i, n in share.items():
            if i not in dims and nranks is not None:
                dims[i] = n * nranks()
        for i in self.opt_dims:
            dims.setdefault(i, 0)
        return dims, share

    def default_dim(self, i: int, tensors: dict, dims: dict, nranks: int, layout: int | None = None) -> int:
        """A free dim's default: capacity the worst case nranks * tokens * topk; a sharded dim every rank's shard
        the size of this one's."""
        split = self.op["dims"][i]["split"]
        if split == "capacity":
            return nranks * dims[self.dim_names.index("tokens")] * dims[self.dim_names.index("topk")]
        for s in self.inputs:
            t = tensors.get(s.name)
            for ax, axis in enumerate(self.axes_of(s, layout)):
                if t is not None and len(axis) == 1 and axis[0]["kind"] == "shard" and axis[0]["dim"] == i:
                    return int(t.shape[ax]) * nranks
        raise ValueError(f"tandem.{self.name}: pass {self.dim_names[i]}=")

    def shape(self, slot: Slot, dims: dict, share: dict, rank, nranks, like=None, layout: int | None = None) -> tuple:
        """The shape of `slot`. rank and nranks are callables, asked only where a term needs them. A raw output is
        shaped as its raw input `like`, the first axis scaled (allgather: [nranks * x.shape[0], *x.shape[1:]]).
        `layout`: the op's layout code, as in bind."""
        def term(t):
            k, d = t["kind"], t["dim"]
            if k == "dim":
                return dims[d]
            if k == "shard":
                return rows_of(dims[d], rank(), nranks())[1]
            if k == "per_rank":
                return share[d] if d in share else dims[d] // nranks()
            if k == "nranks":
                return nranks()
            if k == "blocks":
                return -(-dims[d] // t["value"])
            return t["value"]

        if slot.type == "raw":
            scale = 1
            for axis in slot.axes:
                for t in axis:
                    if not (t["kind"] == "dim" and self.dim_names[t["dim"]] == "bytes"):
                        scale *= term(t)
            return (scale * like.shape[0], *like.shape[1:]) if like.dim() else (scale,)
        out = []
        for axis in self.axes_of(slot, layout):
            n = 1
            for t in axis:
                n *= term(t)
            out.append(n)
        return tuple(out)


def _binds(axis: list) -> tuple[int, str, int] | None:
    """(dim, "dim" or "per_rank", divisor) where an axis of this form gives a dim: one dim term, one per-rank term, or
    a constant times a dim."""
    if len(axis) == 1 and axis[0]["kind"] in ("dim", "per_rank"):
        return axis[0]["dim"], axis[0]["kind"], 1
    if len(axis) == 2 and axis[0]["kind"] == "const" and axis[1]["kind"] == "dim":
        return axis[1]["dim"], "dim", axis[0]["value"]
    return None


SPECS: dict[str, Spec] = {name: Spec(op) for name, op in OPS.items()}
# Every output's name, as the staging copies them back.
OUTPUT_NAMES = frozenset(s.name for sp in SPECS.values() for s in sp.outputs) | {"out"}
