/* _tandem_fastcall: calls a C function pointer with up to four integer arguments, for tandem's hot path.
 *
 * Why: the measured cost of one ctypes foreign call is about 1 us, a METH_FASTCALL call of this module about 0.1 us
 * (python/bench/overhead.py, bench/RESULTS.md "Python binding"); an op on the cpu backend makes two C calls (submit,
 * wait) and one on the cuda backend makes one plus a driver query per tensor in PyTorch's memory. Everything else
 * stays in ctypes (`tandem._capi`), which also serves when this module is not built: it is optional.
 *
 * call(fn, a0=0, a1=0, a2=0, a3=0) -> int: fn(a0, a1, a2, a3) with the GIL released (a wait may block), every
 * argument passed as a 64-bit integer register. That matches the C signatures it serves on x86-64 and AArch64
 * (System V / AAPCS64): pointers, uint64_t, int64_t, unsigned int, and a 16-byte struct of two uint64_t by value
 * (tandem_op_t), which both ABIs pass in two integer registers. The result is the int the function returns.
 * call_out (below) does the same for a function whose first argument is a uint64_t* result. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>

typedef int (*Fn4)(uint64_t, uint64_t, uint64_t, uint64_t);

static int toU64(PyObject* o, uint64_t* out) {
  /* Negative values (an int64_t timeout of -1) are passed as their two's complement bits. */
  if (!PyLong_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "_tandem_fastcall.call takes integers");
    return -1;
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow > 0) {
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)u;
    return 0;
  }
  if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "argument does not fit in 64 bits");
    return -1;
  }
  *out = (uint64_t)v;
  return 0;
}

static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 1 || nargs > 5) {
    PyErr_SetString(PyExc_TypeError, "call(fn, a0=0, a1=0, a2=0, a3=0)");
    return NULL;
  }
  uint64_t v[5] = {0, 0, 0, 0, 0};
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (toU64(args[i], &v[i]) != 0) return NULL;
  }
  if (v[0] == 0) {
    PyErr_SetString(PyExc_ValueError, "_tandem_fastcall.call: fn is NULL");
    return NULL;
  }
  Fn4 fn = (Fn4)(uintptr_t)v[0];
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = fn(v[1], v[2], v[3], v[4]);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

/* call_out(fn, a1=0, a2=0, a3=0) -> int or None: fn(&v, a1, a2, a3) with a uint64_t v of its own, GIL released;
 * v where fn returned 0, else None. For the driver's cuPointerGetAttribute(&value, attribute, pointer), which the
 * cuda backend's registration check makes per segment per op: reading the value back through a ctypes object
 * would cost more than the query. */
typedef int (*Out3)(uint64_t*, uint64_t, uint64_t, uint64_t);

static PyObject* call_out(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 1 || nargs > 4) {
    PyErr_SetString(PyExc_TypeError, "call_out(fn, a1=0, a2=0, a3=0)");
    return NULL;
  }
  uint64_t v[4] = {0, 0, 0, 0};
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (toU64(args[i], &v[i]) != 0) return NULL;
  }
  if (v[0] == 0) {
    PyErr_SetString(PyExc_ValueError, "_tandem_fastcall.call_out: fn is NULL");
    return NULL;
  }
  Out3 fn = (Out3)(uintptr_t)v[0];
  uint64_t out = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = fn(&out, v[1], v[2], v[3]);
  Py_END_ALLOW_THREADS
  if (rc != 0) Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong(out);
}

/* ---- Hot: the whole fast path of the GEMM ops, allgather and barrier, one C call per op ---------------------------
 *
 * Why: with the foreign calls already cheap, what an op call cost on top of libtandem was the interpreter running
 * the Python fast path (tandem/_fastpath.py: _gemm_fast, _ag_gemm_fast, _allgather_fast, _go, _live), about 1.8 us per
 * gemm_ar on the CI machine and 4.9 us on the H200's host. Here the same steps run in C against CPython's API: the
 * tensor reads (exact torch.Tensor / nn.Parameter only: shape, dtype, is_contiguous(), data_ptr(), nbytes), the
 * communicator's pointer cache (its HitCache dict, probed with data_ptr's int), the segment liveness check (one
 * cuPointerGetAttribute per distinct registered segment), the current stream, the argument struct, the C call (and
 * tandem_wait on the cpu backend) with the GIL released, and the completion poll every `poll_every` ops.
 *
 * Anything unusual returns None and the caller takes the Python path, which decides exactly as before (and raises
 * the ValueError naming the argument and the rule): another dtype, shape or layout, a tensor subclass, a pointer
 * the cache does not hold and resolve() (Communicator._resolve_fast) will not add, a dead segment (the cache is
 * cleared first, as _live does), a stream being captured into a CUDA graph (asked first, so a captured call makes
 * no output of its own before the Python path makes its one), a closed communicator. Python errors
 * raised by the tensor reads are cleared for the same reason: the Python path reproduces them with its message.
 * Errors of the op itself (its status, or a poll's) are raised here, through raise_status(rc) / poll().
 *
 * The argument structs are written as 8-byte slots in tandem.h's field order (every field of these four structs is
 * 8 bytes; the dtype enum is 4 bytes plus 4 of padding, written as a little-endian uint64): tandem/_fastpath.py checks
 * each struct's size against its slot count and uses Hot only on a little-endian machine. */

enum { OP_GEMM_AR, OP_GEMM_RS, OP_AG_GEMM, OP_ALLGATHER, OP_BARRIER, OP_COUNT };
enum { NDTYPES = 3 };

typedef struct {
  uint64_t serial, seq;
} OpId; /* tandem_op_t */
typedef int (*OpFn)(void* comm, const void* args, OpId* op);
typedef int (*WaitFn)(OpId op, int64_t timeout_ms);
typedef int (*PtrAttrFn)(void* value, int attribute, uint64_t ptr); /* cuPointerGetAttribute */
#define CU_POINTER_ATTRIBUTE_BUFFER_ID 7

/* A tensor attribute read: through the attribute's descriptor in torch's C tensor type when configure() was given it
 * (a getset's getter or a method's C function, called directly: no attribute lookup, no bound method), else a
 * generic getattr / method call by name. tandem/_fastpath.py passes a descriptor only where torch.Tensor and
 * torch.nn.Parameter both inherit it unchanged, and Hot reads only tensors of exactly those two types. */
enum { READ_GETATTR, READ_CALL, READ_GETSET, READ_NOARGS, READ_VARARGS, READ_VARARGS_KW, READ_FAST, READ_FAST_KW };
enum { A_SHAPE, A_DTYPE, A_IS_CONTIGUOUS, A_DATA_PTR, A_NBYTES, A_COUNT };

typedef PyObject* (*FastFn)(PyObject*, PyObject* const*, Py_ssize_t);
typedef PyObject* (*FastKwFn)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*);

typedef struct {
  int kind;
  PyObject* name; /* interned; for the generic reads */
  getter get;
  void* closure;
  PyCFunction meth;
} Read;

/* A tensor's place in memory, from the communicator's pointer cache (entries (buffer, offset, bytes to its end,
 * Segment or None, segment base, segment buffer id), see _fastpath.py) or, on a miss, resolve(ptr, nbytes). */
typedef struct {
  uint64_t buf, off, base, bid;
  int seg; /* a registered cudaMalloc segment: live() before use */
} Slot;

/* The last cache entry each argument position used, parsed: an entry is an immutable tuple, held here, so the same
 * object found again under the same key has the same values (saves five int conversions per tensor per op). */
typedef struct {
  PyObject* entry;
  Slot slot;
  uint64_t avail;
} Parsed;
enum { MEMO_GEMM = 0, MEMO_AG_GEMM = 3, MEMO_ALLGATHER = 7, NMEMO = 9 };

typedef struct {
  PyObject_HEAD
  /* set by configure() */
  void* comm;
  OpFn fn[OP_COUNT];
  uint64_t* args[OP_COUNT];
  uint64_t size[OP_COUNT];
  OpId* op;
  WaitFn wait;
  PtrAttrFn ptrAttr;
  int cuda, devidx, pollEvery;
  uint64_t rank, nranks;
  int64_t timeoutMs;
  PyObject *keep, *hits, *resolve, *alloc, *poll, *raiseStatus, *rawStream, *capturing, *devidxObj;
  PyTypeObject *tensorType, *paramType;
  PyObject* dtypes[NDTYPES];
  uint64_t dtCode[NDTYPES], elSize[NDTYPES];
  PyObject* descrs; /* keeps the descriptors whose functions reads[] calls */
  Read reads[A_COUNT];
  Parsed memo[NMEMO];
  /* state */
  int sincePoll; /* ops since the last poll (the Python paths count here too) */
  int closed;    /* 1 until configure(), and after Communicator.close() */
} Hot;

static PyObject* sNames[A_COUNT]; /* shape, dtype, is_contiguous, data_ptr, nbytes */
static PyObject* sEmpty;          /* () */

static PyObject* readAttr(const Read* r, PyObject* t) {
  switch (r->kind) {
    case READ_GETSET:
      return r->get(t, r->closure);
    case READ_NOARGS:
      return r->meth(t, NULL);
    case READ_VARARGS:
      return r->meth(t, sEmpty);
    case READ_VARARGS_KW:
      return ((PyCFunctionWithKeywords)(void (*)(void))r->meth)(t, sEmpty, NULL);
    case READ_FAST:
      return ((FastFn)(void (*)(void))r->meth)(t, NULL, 0);
    case READ_FAST_KW:
      return ((FastKwFn)(void (*)(void))r->meth)(t, NULL, 0, NULL);
    case READ_CALL: {
      PyObject* argv[2] = {NULL, t};
      return PyObject_VectorcallMethod(r->name, argv + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    default:
      return PyObject_GetAttr(t, r->name);
  }
}

/* The read of attribute i through descriptor d (None: by name). */
static void setRead(Read* r, int i, PyObject* d) {
  const int method = i == A_IS_CONTIGUOUS || i == A_DATA_PTR;
  r->name = sNames[i];
  r->kind = method ? READ_CALL : READ_GETATTR;
  if (!method && Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
    PyGetSetDef* g = ((PyGetSetDescrObject*)d)->d_getset;
    if (g->get != NULL) {
      r->kind = READ_GETSET;
      r->get = g->get;
      r->closure = g->closure;
    }
  } else if (method && Py_IS_TYPE(d, &PyMethodDescr_Type)) {
    PyMethodDef* m = ((PyMethodDescrObject*)d)->d_method;
    const int flags = m->ml_flags & ~(METH_COEXIST);
    r->meth = m->ml_meth;
    if (flags == METH_NOARGS) r->kind = READ_NOARGS;
    else if (flags == METH_VARARGS) r->kind = READ_VARARGS;
    else if (flags == (METH_VARARGS | METH_KEYWORDS)) r->kind = READ_VARARGS_KW;
    else if (flags == METH_FASTCALL) r->kind = READ_FAST;
    else if (flags == (METH_FASTCALL | METH_KEYWORDS)) r->kind = READ_FAST_KW;
  }
}

#define HOT_OBJECTS(X)                                                                                         \
  X(keep) X(hits) X(resolve) X(alloc) X(poll) X(raiseStatus) X(rawStream) X(capturing) X(devidxObj) X(dtypes[0]) \
  X(dtypes[1]) X(dtypes[2]) X(descrs)

static int hotTraverse(Hot* h, visitproc visit, void* arg) {
#define VISIT(f) Py_VISIT(h->f);
  HOT_OBJECTS(VISIT)
#undef VISIT
  Py_VISIT(h->tensorType);
  Py_VISIT(h->paramType);
  for (int i = 0; i < NMEMO; ++i) Py_VISIT(h->memo[i].entry);
  return 0;
}

static int hotClear(Hot* h) {
  h->closed = 1; /* first: the reads' functions go with descrs */
#define CLEAR(f) Py_CLEAR(h->f);
  HOT_OBJECTS(CLEAR)
#undef CLEAR
  Py_CLEAR(h->tensorType);
  Py_CLEAR(h->paramType);
  for (int i = 0; i < NMEMO; ++i) Py_CLEAR(h->memo[i].entry);
  return 0;
}

static void hotDealloc(Hot* h) {
  PyObject_GC_UnTrack(h);
  hotClear(h);
  Py_TYPE(h)->tp_free((PyObject*)h);
}

static PyObject* hotNew(PyTypeObject* type, PyObject* args, PyObject* kw) {
  (void)args;
  (void)kw;
  Hot* h = (Hot*)type->tp_alloc(type, 0);
  if (h != NULL) h->closed = 1;
  return (PyObject*)h;
}

static int u64Tuple(PyObject* t, uint64_t* out, const char* what) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != OP_COUNT) {
    PyErr_Format(PyExc_TypeError, "Hot.configure: %s must be a tuple of %d integers", what, OP_COUNT);
    return -1;
  }
  for (Py_ssize_t i = 0; i < OP_COUNT; ++i) {
    if (toU64(PyTuple_GET_ITEM(t, i), &out[i]) != 0) return -1;
  }
  return 0;
}

/* configure(comm, fns, args, sizes, op, wait, ptr_attr, cuda, devidx, rank, nranks, timeout_ms, poll_every, keep,
 *           hits, resolve, alloc, poll, raise_status, raw_stream, capturing, tensor_types, dtypes, descriptors)
 * fns / args / sizes: per op in the order gemm_ar, gemm_rs, ag_gemm, allgather, barrier (C function, argument
 * buffer address, struct size). op: the tandem_op_t the ops write. keep: whatever owns those addresses' memory.
 * dtypes: ((torch dtype, tandem dtype code, element size), ...) for the GEMMs' three. descriptors: for shape, dtype,
 * is_contiguous, data_ptr and nbytes, the descriptor torch.Tensor uses, or None (read by name). Opens the object. */
static PyObject* hotConfigure(Hot* h, PyObject* args, PyObject* kw) {
  static char* names[] = {"comm", "fns", "args", "sizes", "op", "wait", "ptr_attr", "cuda", "devidx", "rank",
                          "nranks", "timeout_ms", "poll_every", "keep", "hits", "resolve", "alloc", "poll",
                          "raise_status", "raw_stream", "capturing", "tensor_types", "dtypes", "descriptors", NULL};
  unsigned long long comm, op, wait, ptrAttr, rank, nranks;
  long long timeoutMs;
  int cuda, devidx, pollEvery;
  PyObject *fns, *argv, *sizes, *keep, *hits, *resolve, *alloc, *poll, *raiseStatus, *rawStream, *capturing,
      *types, *dtypes, *descrs;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "KOOOKKKpiKKLiOO!OOOOOOO!O!O!:configure", names, &comm, &fns, &argv,
                                   &sizes, &op, &wait, &ptrAttr, &cuda, &devidx, &rank, &nranks, &timeoutMs,
                                   &pollEvery, &keep, &PyDict_Type, &hits, &resolve, &alloc, &poll, &raiseStatus,
                                   &rawStream, &capturing, &PyTuple_Type, &types, &PyTuple_Type, &dtypes,
                                   &PyTuple_Type, &descrs))
    return NULL;
  if (PyTuple_GET_SIZE(descrs) != A_COUNT) {
    PyErr_SetString(PyExc_TypeError, "Hot.configure: descriptors is 5 descriptors or None");
    return NULL;
  }
  uint64_t f[OP_COUNT], a[OP_COUNT], s[OP_COUNT];
  if (u64Tuple(fns, f, "fns") || u64Tuple(argv, a, "args") || u64Tuple(sizes, s, "sizes")) return NULL;
  if (comm == 0 || op == 0 || (!cuda && wait == 0) || (cuda && ptrAttr == 0) || nranks == 0 || pollEvery < 1) {
    PyErr_SetString(PyExc_ValueError, "Hot.configure: a required address or count is 0");
    return NULL;
  }
  for (int i = 0; i < OP_COUNT; ++i) {
    if (f[i] == 0 || a[i] == 0 || s[i] == 0) {
      PyErr_SetString(PyExc_ValueError, "Hot.configure: an op's function, arguments or size is 0");
      return NULL;
    }
  }
  if (PyTuple_GET_SIZE(types) != 2 || !PyType_Check(PyTuple_GET_ITEM(types, 0)) ||
      !PyType_Check(PyTuple_GET_ITEM(types, 1)) || PyTuple_GET_SIZE(dtypes) != NDTYPES) {
    PyErr_SetString(PyExc_TypeError, "Hot.configure: tensor_types is (torch.Tensor, torch.nn.Parameter), dtypes 3");
    return NULL;
  }
  uint64_t code[NDTYPES], el[NDTYPES];
  for (int i = 0; i < NDTYPES; ++i) {
    PyObject* d = PyTuple_GET_ITEM(dtypes, i);
    if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != 3 || toU64(PyTuple_GET_ITEM(d, 1), &code[i]) ||
        toU64(PyTuple_GET_ITEM(d, 2), &el[i])) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Hot.configure: dtypes are (dtype, code, size)");
      return NULL;
    }
  }
  PyObject* devObj = PyLong_FromLong(devidx);
  if (devObj == NULL) return NULL;
  h->comm = (void*)(uintptr_t)comm;
  for (int i = 0; i < OP_COUNT; ++i) {
    h->fn[i] = (OpFn)(uintptr_t)f[i];
    h->args[i] = (uint64_t*)(uintptr_t)a[i];
    h->size[i] = s[i];
  }
  h->op = (OpId*)(uintptr_t)op;
  h->wait = (WaitFn)(uintptr_t)wait;
  h->ptrAttr = (PtrAttrFn)(uintptr_t)ptrAttr;
  h->cuda = cuda;
  h->devidx = devidx;
  h->rank = rank;
  h->nranks = nranks;
  h->timeoutMs = timeoutMs;
  h->pollEvery = pollEvery;
  Py_XSETREF(h->devidxObj, devObj);
  h->closed = 1; /* while the reads change */
#define SET(f, v) Py_INCREF(v); Py_XSETREF(h->f, v);
  SET(keep, keep) SET(hits, hits) SET(resolve, resolve) SET(alloc, alloc) SET(poll, poll)
  SET(raiseStatus, raiseStatus) SET(rawStream, rawStream) SET(capturing, capturing) SET(descrs, descrs)
#undef SET
  for (int i = 0; i < A_COUNT; ++i) setRead(&h->reads[i], i, PyTuple_GET_ITEM(descrs, i));
  PyObject* tt = PyTuple_GET_ITEM(types, 0);
  PyObject* pt = PyTuple_GET_ITEM(types, 1);
  Py_INCREF(tt);
  Py_XSETREF(h->tensorType, (PyTypeObject*)tt);
  Py_INCREF(pt);
  Py_XSETREF(h->paramType, (PyTypeObject*)pt);
  for (int i = 0; i < NDTYPES; ++i) {
    PyObject* d = PyTuple_GET_ITEM(PyTuple_GET_ITEM(dtypes, i), 0);
    Py_INCREF(d);
    Py_XSETREF(h->dtypes[i], d);
    h->dtCode[i] = code[i];
    h->elSize[i] = el[i];
  }
  h->closed = 0;
  Py_RETURN_NONE;
}

/* ---- tensor reads. Each returns 1 (the common case, values filled), 0 (not the common case, or a read raised:
 * the Python path decides) or -1 (an error of our own to raise, e.g. out of memory). */
#define FALLBACK()   \
  do {               \
    PyErr_Clear();   \
    return 0;        \
  } while (0)

static inline int isTensor(Hot* h, PyObject* t) {
  PyTypeObject* tp = Py_TYPE(t);
  return tp == h->tensorType || tp == h->paramType;
}

/* t.is_contiguous() is True */
static int contiguous(Hot* h, PyObject* t) {
  PyObject* r = readAttr(&h->reads[A_IS_CONTIGUOUS], t);
  if (r == NULL) FALLBACK();
  int ok = r == Py_True;
  Py_DECREF(r);
  return ok;
}

/* dtype of t: new reference in *dtype, and its index among the GEMM dtypes in *idx (-1: another dtype) */
static int dtypeOf(Hot* h, PyObject* t, PyObject** dtype, int* idx) {
  PyObject* d = readAttr(&h->reads[A_DTYPE], t);
  if (d == NULL) FALLBACK();
  *idx = -1;
  for (int i = 0; i < NDTYPES; ++i) {
    if (d == h->dtypes[i]) *idx = i;
  }
  *dtype = d;
  return 1;
}

/* shape of t, a 2-D contiguous tensor of dtype index *idx (checked against want when want >= 0) */
static int matrix(Hot* h, PyObject* t, int want, int* idx, int64_t* d0, int64_t* d1) {
  if (!isTensor(h, t)) return 0;
  PyObject* dt;
  int r = dtypeOf(h, t, &dt, idx);
  if (r != 1) return r;
  Py_DECREF(dt); /* compared by identity only: torch keeps its dtype objects for the process's life */
  if (*idx < 0 || (want >= 0 && *idx != want)) return 0;
  PyObject* s = readAttr(&h->reads[A_SHAPE], t);
  if (s == NULL) FALLBACK();
  if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) != 2) {
    Py_DECREF(s);
    return 0;
  }
  *d0 = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 0));
  *d1 = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 1));
  Py_DECREF(s);
  if (PyErr_Occurred()) FALLBACK();
  return contiguous(h, t);
}


/* e's slot where it covers nbytes (1), else 0; remembered in *p */
static int parseEntry(Parsed* p, PyObject* e, uint64_t nbytes, Slot* s) {
  if (e != p->entry) {
    Slot v;
    uint64_t avail;
    if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) < 6) return 0;
    if (toU64(PyTuple_GET_ITEM(e, 2), &avail) || toU64(PyTuple_GET_ITEM(e, 0), &v.buf) ||
        toU64(PyTuple_GET_ITEM(e, 1), &v.off) || toU64(PyTuple_GET_ITEM(e, 4), &v.base) ||
        toU64(PyTuple_GET_ITEM(e, 5), &v.bid))
      FALLBACK();
    v.seg = PyTuple_GET_ITEM(e, 3) != Py_None;
    Py_INCREF(e);
    Py_XSETREF(p->entry, e);
    p->slot = v;
    p->avail = avail;
  }
  if (p->avail < nbytes) return 0;
  *s = p->slot;
  return 1;
}

static int slotOf(Hot* h, PyObject* t, uint64_t nbytes, Slot* s, int memo) {
  Parsed* p = &h->memo[memo];
  PyObject* ptr = readAttr(&h->reads[A_DATA_PTR], t);
  if (ptr == NULL) FALLBACK();
  PyObject* e = PyDict_GetItemWithError(h->hits, ptr); /* borrowed; an int key's hash cannot run Python code */
  int r = e != NULL ? parseEntry(p, e, nbytes, s) : 0;
  if (r == 0 && !PyErr_Occurred()) {
    PyObject* n = PyLong_FromUnsignedLongLong(nbytes);
    if (n == NULL) {
      Py_DECREF(ptr);
      return -1;
    }
    PyObject* argv[3] = {NULL, ptr, n};
    e = PyObject_Vectorcall(h->resolve, argv + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(n);
    if (e == NULL) {
      Py_DECREF(ptr);
      FALLBACK();
    }
    r = e == Py_None ? 0 : parseEntry(p, e, nbytes, s);
    Py_DECREF(e);
  }
  Py_DECREF(ptr);
  if (PyErr_Occurred()) FALLBACK();
  return r;
}

/* cuda: every distinct registered segment among the slots still carries its buffer id (the driver's answer, as
 * SegmentCache.live); a dead one clears the pointer cache (as Communicator._live) and sends the op to the Python
 * path, which registers afresh. */
static int live(Hot* h, const Slot* s, int n) {
  for (int i = 0; i < n; ++i) {
    if (!s[i].seg) continue;
    int seen = 0;
    for (int j = 0; j < i; ++j) seen |= s[j].seg && s[j].bid == s[i].bid;
    if (seen) continue;
    unsigned long long id = 0;
    if (h->ptrAttr(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, s[i].base) != 0 || id != s[i].bid) {
      PyDict_Clear(h->hits);
      return 0;
    }
  }
  return 1;
}

/* cuda: the current stream of the communicator's device (0: the legacy default stream), and whether it is being
 * captured (only asked for another stream: capture never runs on the legacy stream). 0: take the Python path. */
static int stream(Hot* h, uint64_t* out) {
  *out = 0;
  if (!h->cuda) return 1;
  if (h->rawStream == Py_None) return 0;
  PyObject* argv[2] = {NULL, h->devidxObj};
  PyObject* r = PyObject_Vectorcall(h->rawStream, argv + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
  if (r == NULL) FALLBACK();
  int bad = toU64(r, out);
  Py_DECREF(r);
  if (bad) FALLBACK();
  if (*out == 0) return 1;
  r = PyObject_CallNoArgs(h->capturing);
  if (r == NULL) FALLBACK();
  int capturing = PyObject_IsTrue(r);
  Py_DECREF(r);
  if (capturing != 0) FALLBACK(); /* capturing, or an error: the Python path records it into the graph */
  return 1;
}

/* Submits the packed op (cpu backend: waits for it), GIL released; raises its status's exception; cuda: counts
 * it and polls every pollEvery ops. 0 on success, -1 with an exception set. */
static int submit(Hot* h, int op) {
  int rc;
  OpFn fn = h->fn[op];
  const uint64_t* args = h->args[op];
  Py_BEGIN_ALLOW_THREADS
  rc = fn(h->comm, args, h->op);
  if (rc == 0 && !h->cuda) rc = h->wait(*h->op, h->timeoutMs);
  Py_END_ALLOW_THREADS
  if (rc != 0) {
    PyObject* code = PyLong_FromLong(rc);
    if (code == NULL) return -1;
    PyObject* r = PyObject_CallOneArg(h->raiseStatus, code);
    Py_DECREF(code);
    if (r != NULL) { /* raise_status always raises */
      Py_DECREF(r);
      PyErr_Format(PyExc_RuntimeError, "tandem: status %d", rc);
    }
    return -1;
  }
  if (h->cuda && ++h->sincePoll >= h->pollEvery) {
    PyObject* r = PyObject_CallNoArgs(h->poll);
    if (r == NULL) return -1;
    Py_DECREF(r);
  }
  return 0;
}

static PyObject* allocate(Hot* h, int64_t d0, int64_t d1, PyObject* dtype) {
  PyObject* shape = Py_BuildValue("(LL)", (long long)d0, (long long)d1);
  if (shape == NULL) return NULL;
  PyObject* argv[3] = {NULL, shape, dtype};
  PyObject* t = PyObject_Vectorcall(h->alloc, argv + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
  Py_DECREF(shape);
  return t;
}

static uint64_t rowsOf(const Hot* h, uint64_t m) {
  return m / h->nranks + (h->rank < m % h->nranks ? 1 : 0);
}

/* Returns for "not the common case": the caller's Python path takes over. */
#define PYTHON_PATH(r)          \
  do {                          \
    if ((r) < 0) goto fail;     \
    Py_XDECREF(made);           \
    Py_RETURN_NONE;             \
  } while (0)

/* gemm_ar / gemm_rs(a, b, out) -> out, or None */
static PyObject* gemmReduce(Hot* h, PyObject* const* argv, Py_ssize_t n, int op) {
  PyObject* made = NULL;
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "Hot.gemm_ar/gemm_rs(a, b, out)");
    return NULL;
  }
  if (h->closed) Py_RETURN_NONE;
  PyObject *a = argv[0], *b = argv[1], *out = argv[2];
  int ia, ib, ic, r;
  int64_t m, k, nn, kb, r0, r1;
  uint64_t st;
  if ((r = stream(h, &st)) != 1) PYTHON_PATH(r); /* first: a capture takes the Python path before any allocation */
  if ((r = matrix(h, a, -1, &ia, &m, &k)) != 1) PYTHON_PATH(r);
  if ((r = matrix(h, b, ia, &ib, &nn, &kb)) != 1) PYTHON_PATH(r);
  if (kb != k || m < 0 || k < 0 || nn < 0) Py_RETURN_NONE;
  const uint64_t rows = op == OP_GEMM_AR ? (uint64_t)m : rowsOf(h, (uint64_t)m);
  if (out == Py_None) {
    out = made = allocate(h, (int64_t)rows, nn, h->dtypes[ia]);
    if (out == NULL) return NULL;
  } else {
    if ((r = matrix(h, out, ia, &ic, &r0, &r1)) != 1) PYTHON_PATH(r);
    if ((uint64_t)r0 != rows || r1 != nn) Py_RETURN_NONE;
  }
  const uint64_t es = h->elSize[ia];
  Slot s[3];
  if ((r = slotOf(h, a, (uint64_t)m * k * es, &s[0], MEMO_GEMM)) != 1) PYTHON_PATH(r);
  if ((r = slotOf(h, b, (uint64_t)nn * k * es, &s[1], MEMO_GEMM + 1)) != 1) PYTHON_PATH(r);
  if ((r = slotOf(h, out, rows * nn * es, &s[2], MEMO_GEMM + 2)) != 1) PYTHON_PATH(r);
  if (h->cuda && !live(h, s, 3)) PYTHON_PATH(0);
  uint64_t* v = h->args[op];
  v[0] = h->size[op];
  v[1] = h->dtCode[ia];
  v[2] = (uint64_t)m;
  v[3] = (uint64_t)nn;
  v[4] = (uint64_t)k;
  for (int i = 0; i < 3; ++i) {
    v[5 + 2 * i] = s[i].buf;
    v[6 + 2 * i] = s[i].off;
  }
  v[11] = st;
  if (submit(h, op) != 0) goto fail;
  if (made == NULL) Py_INCREF(out);
  return out;
fail:
  Py_XDECREF(made);
  return NULL;
}

static PyObject* hotGemmAr(Hot* h, PyObject* const* argv, Py_ssize_t n) { return gemmReduce(h, argv, n, OP_GEMM_AR); }
static PyObject* hotGemmRs(Hot* h, PyObject* const* argv, Py_ssize_t n) { return gemmReduce(h, argv, n, OP_GEMM_RS); }

/* ag_gemm(a, b, out, m, a_gathered) -> out, or None */
static PyObject* hotAgGemm(Hot* h, PyObject* const* argv, Py_ssize_t n) {
  PyObject* made = NULL;
  if (n != 5) {
    PyErr_SetString(PyExc_TypeError, "Hot.ag_gemm(a, b, out, m, a_gathered)");
    return NULL;
  }
  if (h->closed) Py_RETURN_NONE;
  PyObject *a = argv[0], *b = argv[1], *out = argv[2], *mo = argv[3], *g = argv[4];
  int ia, ib, ic, r;
  int64_t rows, k, nn, kb, m = -1, r0 = 0, r1 = 0;
  uint64_t st;
  if ((r = stream(h, &st)) != 1) PYTHON_PATH(r); /* first: a capture takes the Python path before any allocation */
  if ((r = matrix(h, a, -1, &ia, &rows, &k)) != 1) PYTHON_PATH(r);
  if ((r = matrix(h, b, ia, &ib, &nn, &kb)) != 1) PYTHON_PATH(r);
  if (kb != k || rows < 0 || k < 0 || nn < 0) Py_RETURN_NONE;
  if (out != Py_None) {
    if ((r = matrix(h, out, ia, &ic, &r0, &r1)) != 1) PYTHON_PATH(r);
    if (r1 != nn) Py_RETURN_NONE;
  }
  if (mo == Py_None) {
    m = out == Py_None ? rows * (int64_t)h->nranks : r0;
  } else {
    if (!PyLong_CheckExact(mo)) Py_RETURN_NONE;
    m = PyLong_AsLongLong(mo);
    if (m == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  if (m < 0 || rowsOf(h, (uint64_t)m) != (uint64_t)rows) Py_RETURN_NONE;
  if (out == Py_None) {
    out = made = allocate(h, m, nn, h->dtypes[ia]);
    if (out == NULL) return NULL;
  } else if (r0 != m) {
    Py_RETURN_NONE;
  }
  const uint64_t es = h->elSize[ia];
  Slot s[4] = {{0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}};
  if (g != Py_None) {
    int ig;
    int64_t g0, g1;
    if ((r = matrix(h, g, ia, &ig, &g0, &g1)) != 1) PYTHON_PATH(r);
    if (g0 != m || g1 != k) PYTHON_PATH(0);
  }
  if ((r = slotOf(h, a, (uint64_t)rows * k * es, &s[0], MEMO_AG_GEMM)) != 1) PYTHON_PATH(r);
  if ((r = slotOf(h, b, (uint64_t)nn * k * es, &s[1], MEMO_AG_GEMM + 1)) != 1) PYTHON_PATH(r);
  if ((r = slotOf(h, out, (uint64_t)m * nn * es, &s[2], MEMO_AG_GEMM + 2)) != 1) PYTHON_PATH(r);
  if (g != Py_None && (r = slotOf(h, g, (uint64_t)m * k * es, &s[3], MEMO_AG_GEMM + 3)) != 1) PYTHON_PATH(r);
  if (h->cuda && !live(h, s, 4)) PYTHON_PATH(0);
  uint64_t* v = h->args[OP_AG_GEMM];
  v[0] = h->size[OP_AG_GEMM];
  v[1] = h->dtCode[ia];
  v[2] = (uint64_t)m;
  v[3] = (uint64_t)nn;
  v[4] = (uint64_t)k;
  for (int i = 0; i < 4; ++i) {
    v[5 + 2 * i] = s[i].buf;
    v[6 + 2 * i] = s[i].off;
  }
  v[13] = st;
  if (submit(h, OP_AG_GEMM) != 0) goto fail;
  if (made == NULL) Py_INCREF(out);
  return out;
fail:
  Py_XDECREF(made);
  return NULL;
}

static int nbytesOf(Hot* h, PyObject* t, uint64_t* out) {
  PyObject* nb = readAttr(&h->reads[A_NBYTES], t);
  if (nb == NULL) FALLBACK();
  int bad = toU64(nb, out);
  Py_DECREF(nb);
  if (bad) FALLBACK();
  return 1;
}

/* allgather(x, out) -> out, or None. x: any dtype and shape; out: ranks * x.numel() elements of x's dtype. */
static PyObject* hotAllgather(Hot* h, PyObject* const* argv, Py_ssize_t n) {
  PyObject *made = NULL, *dt = NULL;
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "Hot.allgather(x, out)");
    return NULL;
  }
  if (h->closed) Py_RETURN_NONE;
  PyObject *x = argv[0], *out = argv[1];
  int idx, r;
  uint64_t nb, onb, st;
  if (!isTensor(h, x) || (out != Py_None && !isTensor(h, out))) Py_RETURN_NONE;
  if ((r = stream(h, &st)) != 1) PYTHON_PATH(r); /* before any allocation, as the GEMMs */
  if ((r = dtypeOf(h, x, &dt, &idx)) != 1) PYTHON_PATH(r);
  if ((r = contiguous(h, x)) != 1 || (r = nbytesOf(h, x, &nb)) != 1) goto python_path;
  if (out == Py_None) {
    PyObject* s = readAttr(&h->reads[A_SHAPE], x);
    if (s == NULL || !PyTuple_Check(s)) {
      Py_XDECREF(s);
      r = 0;
      goto python_path;
    }
    const Py_ssize_t nd = PyTuple_GET_SIZE(s);
    PyObject* shape = PyTuple_New(nd ? nd : 1);
    if (shape == NULL) {
      Py_DECREF(s);
      r = -1;
      goto python_path;
    }
    long long d0 = nd ? PyLong_AsLongLong(PyTuple_GET_ITEM(s, 0)) : 1;
    PyObject* first = PyLong_FromLongLong(d0 * (long long)h->nranks);
    if (first == NULL) {
      Py_DECREF(s);
      Py_DECREF(shape);
      r = 0;
      goto python_path;
    }
    PyTuple_SET_ITEM(shape, 0, first);
    for (Py_ssize_t i = 1; i < nd; ++i) {
      PyObject* d = PyTuple_GET_ITEM(s, i);
      Py_INCREF(d);
      PyTuple_SET_ITEM(shape, i, d);
    }
    Py_DECREF(s);
    PyObject* av[3] = {NULL, shape, dt};
    out = made = PyObject_Vectorcall(h->alloc, av + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(shape);
    if (out == NULL) {
      r = -1;
      goto python_path;
    }
  } else {
    PyObject* odt;
    int oidx;
    if ((r = dtypeOf(h, out, &odt, &oidx)) != 1) goto python_path;
    Py_DECREF(odt);
    if (odt != dt || (r = contiguous(h, out)) != 1 || (r = nbytesOf(h, out, &onb)) != 1) goto python_path;
    if (onb != nb * h->nranks) {
      r = 0;
      goto python_path;
    }
  }
  Slot s[2];
  if ((r = slotOf(h, x, nb, &s[0], MEMO_ALLGATHER)) != 1 ||
      (r = slotOf(h, out, nb * h->nranks, &s[1], MEMO_ALLGATHER + 1)) != 1)
    goto python_path;
  if (h->cuda && !live(h, s, 2)) {
    r = 0;
    goto python_path;
  }
  Py_CLEAR(dt);
  uint64_t* v = h->args[OP_ALLGATHER];
  v[0] = h->size[OP_ALLGATHER];
  v[1] = s[0].buf;
  v[2] = s[0].off;
  v[3] = s[1].buf;
  v[4] = s[1].off;
  v[5] = nb;
  v[6] = st;
  if (submit(h, OP_ALLGATHER) != 0) goto fail;
  if (made == NULL) Py_INCREF(out);
  return out;
python_path:
  if (r == 0) PyErr_Clear();
  Py_XDECREF(dt);
  if (r < 0) goto fail;
  Py_XDECREF(made);
  Py_RETURN_NONE;
fail:
  Py_XDECREF(made);
  return NULL;
}

/* barrier() -> True, or None */
static PyObject* hotBarrier(Hot* h, PyObject* const* argv, Py_ssize_t n) {
  PyObject* made = NULL;
  (void)argv;
  if (n != 0) {
    PyErr_SetString(PyExc_TypeError, "Hot.barrier()");
    return NULL;
  }
  if (h->closed) Py_RETURN_NONE;
  uint64_t st;
  int r;
  if ((r = stream(h, &st)) != 1) PYTHON_PATH(r);
  uint64_t* v = h->args[OP_BARRIER];
  v[0] = h->size[OP_BARRIER];
  v[1] = st;
  if (submit(h, OP_BARRIER) != 0) return NULL;
  Py_RETURN_TRUE;
fail:
  return NULL;
}

static PyMethodDef hotMethods[] = {
    {"configure", (PyCFunction)(void (*)(void))hotConfigure, METH_VARARGS | METH_KEYWORDS,
     "configure(comm=, fns=, args=, sizes=, op=, ...): the communicator's addresses and Python callbacks"},
    {"gemm_ar", (PyCFunction)(void (*)(void))hotGemmAr, METH_FASTCALL, "gemm_ar(a, b, out) -> out, or None"},
    {"gemm_rs", (PyCFunction)(void (*)(void))hotGemmRs, METH_FASTCALL, "gemm_rs(a, b, out) -> out, or None"},
    {"ag_gemm", (PyCFunction)(void (*)(void))hotAgGemm, METH_FASTCALL,
     "ag_gemm(a, b, out, m, a_gathered) -> out, or None"},
    {"allgather", (PyCFunction)(void (*)(void))hotAllgather, METH_FASTCALL, "allgather(x, out) -> out, or None"},
    {"barrier", (PyCFunction)(void (*)(void))hotBarrier, METH_FASTCALL, "barrier() -> True, or None"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef hotMembers[] = {
    {"since_poll", T_INT, offsetof(Hot, sincePoll), 0, "cuda: ops submitted since the last completion poll"},
    {"closed", T_INT, offsetof(Hot, closed), 0, "True: every op returns None (the Python path decides)"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_tandem_fastcall.Hot",
    .tp_basicsize = sizeof(Hot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One communicator's fast path of the GEMM ops, allgather and barrier (see _tandem_fastcall.c)",
    .tp_new = hotNew,
    .tp_dealloc = (destructor)hotDealloc,
    .tp_traverse = (traverseproc)hotTraverse,
    .tp_clear = (inquiry)hotClear,
    .tp_methods = hotMethods,
    .tp_members = hotMembers,
};

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(fn, a0=0, a1=0, a2=0, a3=0) -> int: the C function at address fn with integer arguments, GIL released"},
    {"call_out", (PyCFunction)(void (*)(void))call_out, METH_FASTCALL,
     "call_out(fn, a1=0, a2=0, a3=0) -> int or None: fn(&v, a1, a2, a3); v if it returned 0, else None"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tandem_fastcall", NULL, -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__tandem_fastcall(void) {
  static const char* const names[A_COUNT] = {"shape", "dtype", "is_contiguous", "data_ptr", "nbytes"};
  for (int i = 0; i < A_COUNT; ++i) {
    if ((sNames[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
  }
  if ((sEmpty = PyTuple_New(0)) == NULL || PyType_Ready(&HotType) < 0) return NULL;
  PyObject* m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  Py_INCREF(&HotType);
  if (PyModule_AddObject(m, "Hot", (PyObject*)&HotType) < 0) {
    Py_DECREF(&HotType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
