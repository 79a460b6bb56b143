"""libtandem through ctypes: finding the library, its C signatures, and the op argument structs.

Why ctypes and not a compiled extension: the package then needs no compiler, no Python headers and no torch
headers to install, and it binds only the stable C ABI (tandem.h), so one install works with any PyTorch. The
per-call cost was measured against a pybind11 module calling the same C functions (python/bench/overhead.py,
bench/RESULTS.md "Python binding"); the difference is well under the 3 us a call may add.

Argument structs are packed with struct.pack_into into one preallocated buffer per op kind: a single C call,
where setting ten ctypes Structure fields costs ten attribute writes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import struct
import sys
from pathlib import Path

# The ABI this package is written against: tandem.h 0.2.x. A library of another 0.x minor has another ABI.
ABI_MAJOR, ABI_MINOR = 0, 2
SONAME = f"libtandem.so.{ABI_MAJOR}.{ABI_MINOR}"

c_void_p, c_uint64, c_uint32, c_int, c_int64, c_size_t, c_char_p = (
    ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t,
    ctypes.c_char_p)


class Op(ctypes.Structure):
    """tandem_op_t: {session_serial, seq}, passed by value."""
    _fields_ = [("session_serial", c_uint64), ("seq", c_uint64)]


class CommConfig(ctypes.Structure):
    """tandem_comm_config_t."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("workspace_bytes", ctypes.c_uint64)]


class UniqueId(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint8 * 16)]


# Status codes (tandem_status_t).
SUCCESS = 0
NOT_FOUND = 5
IN_PROGRESS = 15

# dtype codes (tandem_dtype_t).
DTYPE_FP32, DTYPE_FP16, DTYPE_BF16, DTYPE_INT32 = 1, 2, 3, 4

class LibraryNotFound(ImportError):
    pass


def _candidates() -> list[tuple[str, str]]:
    """Where libtandem may be, in the order tried, each with where it came from (for the error message)."""
    out: list[tuple[str, str]] = []
    env = os.environ.get("TANDEM_LIBRARY")
    if env:
        return [(env, "$TANDEM_LIBRARY")]  # an explicit choice is the only one tried
    try:
        from . import _install_config  # written by setup.py when it found a build tree at install time
        if _install_config.LIBRARY:
            out.append((_install_config.LIBRARY, "the build tree found by pip install"))
    except ImportError:
        pass
    # A source checkout (python/tandem inside the repository): its build trees.
    repo = Path(__file__).resolve().parents[2]
    if (repo / "client" / "include" / "tandem" / "tandem.h").exists():
        build = os.environ.get("TANDEM_BUILD_DIR")
        dirs = [Path(build)] if build else [repo / "build"]
        for d in dirs:
            for lib in [d / "client" / SONAME, *sorted((d / "client").glob(SONAME + ".*"))]:
                out.append((str(lib), "the build tree " + str(d)))
    # The dynamic loader's own search (LD_LIBRARY_PATH, ldconfig's cache of /usr/local/lib and friends), then the
    # usual install prefixes (cmake --install's default /usr/local, and this Python's prefix).
    out.append((SONAME, "the dynamic loader's search path"))
    for prefix in ("/usr/local", sys.prefix, "/usr"):
        for libdir in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"):
            out.append((os.path.join(prefix, libdir, SONAME), "the install prefix " + prefix))
    return out


def load_library() -> tuple[ctypes.CDLL, str]:
    tried = []
    for path, origin in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} ({origin}: no such file)")
            continue
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL), path
        except OSError as e:
            tried.append(f"{path} ({origin}: {e})")
    raise LibraryNotFound(
        f"tandem: cannot load {SONAME} (libtandem {ABI_MAJOR}.{ABI_MINOR}). Tried:\n  " + "\n  ".join(tried) +
        "\nBuild it (./scripts/build.sh) or install it (cmake --install build), or set TANDEM_LIBRARY to the "
        "library file.")


def _declare(lib: ctypes.CDLL) -> None:
    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    fn("tandem_strerror", c_char_p, c_int)
    fn("tandem_last_error", c_char_p)
    fn("tandem_version", c_char_p)
    fn("tandem_get_version", c_int, ctypes.POINTER(c_int), ctypes.POINTER(c_int), ctypes.POINTER(c_int))
    fn("tandem_connect", c_int, c_char_p, ctypes.POINTER(c_void_p))
    fn("tandem_disconnect", c_int, c_void_p)
    fn("tandem_session_backend", c_char_p, c_void_p)
    fn("tandem_alloc", c_int, c_void_p, c_uint64, ctypes.POINTER(c_void_p))
    fn("tandem_free", c_int, c_void_p)
    fn("tandem_buffer_ptr", c_void_p, c_void_p)
    fn("tandem_buffer_size", c_uint64, c_void_p)
    fn("tandem_register", c_int, c_void_p, c_void_p, c_uint64, c_int, c_uint64, ctypes.POINTER(c_void_p))
    fn("tandem_deregister", c_int, c_void_p)
    fn("tandem_get_unique_id", c_int, ctypes.POINTER(UniqueId))
    fn("tandem_comm_init", c_int, c_void_p, ctypes.POINTER(UniqueId), c_uint32, c_uint32, c_uint32,
       ctypes.POINTER(c_void_p))
    fn("tandem_comm_init_config", c_int, c_void_p, ctypes.POINTER(UniqueId), c_uint32, c_uint32, c_uint32,
       ctypes.POINTER(CommConfig), ctypes.POINTER(c_void_p))
    fn("tandem_comm_abort", c_int, c_void_p)
    fn("tandem_comm_destroy", c_int, c_void_p)
    fn("tandem_comm_rank", c_uint32, c_void_p)
    fn("tandem_comm_nranks", c_uint32, c_void_p)
    fn("tandem_wait", c_int, Op, c_int64)
    fn("tandem_op_status", c_int, Op, c_char_p, c_size_t)
    fn("tandem_op_table", c_char_p)


lib, library_path = load_library()
_declare(lib)

_major, _minor, _patch = c_int(), c_int(), c_int()
lib.tandem_get_version(ctypes.byref(_major), ctypes.byref(_minor), ctypes.byref(_patch))
library_version = (_major.value, _minor.value, _patch.value)
if library_version[:2] != (ABI_MAJOR, ABI_MINOR):
    raise LibraryNotFound(
        f"tandem: {library_path} is libtandem {'.'.join(map(str, library_version))}, but this package speaks the "
        f"{ABI_MAJOR}.{ABI_MINOR} ABI. Install the matching package (pip install ./python from the same checkout), "
        "or point TANDEM_LIBRARY at a 0.2 library.")


# The ops, as the library describes them (tandem_op_table): every op's argument struct, C function, dims and slots come
# from there, so an op the library gains appears here without an edit.
OPS: dict = {op["py_name"]: op for op in json.loads(lib.tandem_op_table())["ops"]}

# Argument struct layouts: size_t struct_size, then each field at the offset the library gives (its C compiler's, on
# LP64), padded to the struct's size. A tensor is {buffer pointer, uint64 offset}.
# 'Q' = uint64/size_t/pointer, 'i' = int/enum, 'f' = float, 'x' = pad byte.
_FIELD_CODES = {"dtype": "i", "flag": "i", "scale": "f", "dim": "Q", "stream": "Q", "tensor": "QQ"}


def _arg_format(op: dict) -> str:
    fmt, at = "=Q", 8
    for f in op["fields"]:
        code = _FIELD_CODES[f["kind"]]
        if f["offset"] > at:
            fmt += f"{f['offset'] - at}x"
        fmt += code
        at = f["offset"] + struct.calcsize("=" + code)
    if op["struct_size"] > at:
        fmt += f"{op['struct_size'] - at}x"
    return fmt


def enum_names(values: str) -> dict:
    """An enum field's values from the table's text ("TANDEM_GEMM_NT (0), TANDEM_GEMM_NN (1) or TANDEM_GEMM_TN (2)"):
    {name: code}, each name lower case without the prefix all share ({"nt": 0, "nn": 1, "tn": 2})."""
    pairs = re.findall(r"([A-Za-z_][A-Za-z0-9_]*) \((\d+)\)", values)
    prefix = os.path.commonprefix([p[0] for p in pairs])
    prefix = prefix[:prefix.rfind("_") + 1]
    return {name[len(prefix):].lower(): int(code) for name, code in pairs}


# Each op's enum fields, {op: {field: {name: code}}} (ring_attention's layout, the GEMM ops' layout), so Python
# accepts the names the library lists and an enum the library gains needs no edit here.
ENUMS = {name: {f["name"]: enum_names(f["values"]) for f in op["fields"] if f["kind"] == "flag" and f["enum"]}
         for name, op in OPS.items()}
# tandem_attention_layout_t.
LAYOUTS = ENUMS.get("ring_attention", {}).get("layout") or {"contiguous": 0, "zigzag": 1}

ARG_FORMATS = {name: _arg_format(op) for name, op in OPS.items()}
ARG_STRUCTS = {name: struct.Struct(fmt) for name, fmt in ARG_FORMATS.items()}
C_FUNCTIONS = {name: op["c_function"] for name, op in OPS.items()}
for _cname in C_FUNCTIONS.values():
    # (comm, const args*, op*): the args pointer is passed as an address (int) into a preallocated buffer.
    _f = getattr(lib, _cname)
    _f.restype, _f.argtypes = c_int, [c_void_p, c_void_p, ctypes.POINTER(Op)]


def address(fn) -> int:
    """The C address of a ctypes function."""
    return ctypes.cast(fn, ctypes.c_void_p).value


# The hot path's foreign calls go through _tandem_fastcall where it was built (pip install compiles it when a C
# compiler and Python's headers are there): about 0.1 us a call instead of ctypes' 1 us. TANDEM_NO_FASTCALL=1
# uses ctypes alone.
# Hot: the module's whole fast path of the GEMM ops, allgather and barrier (one C call per op; tandem/_fastpath.py).
fastcall = None
fastcall_out = None  # fn(&uint64, a1, a2, a3) -> the uint64 or None (the cuda backend's per-segment driver query)
Hot = None
if os.environ.get("TANDEM_NO_FASTCALL", "0") in ("", "0"):
    try:
        import _tandem_fastcall
        fastcall = _tandem_fastcall.call
        fastcall_out = getattr(_tandem_fastcall, "call_out", None)  # a module built before call_out lacks it
        Hot = getattr(_tandem_fastcall, "Hot", None)  # and one built before Hot lacks that
    except ImportError:
        fastcall = None


def last_error() -> str:
    msg = lib.tandem_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def strerror(status: int) -> str:
    s = lib.tandem_strerror(status)
    return s.decode() if s else f"status {status}"
