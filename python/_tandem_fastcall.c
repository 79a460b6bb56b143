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

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(fn, a0=0, a1=0, a2=0, a3=0) -> int: the C function at address fn with integer arguments, GIL released"},
    {"call_out", (PyCFunction)(void (*)(void))call_out, METH_FASTCALL,
     "call_out(fn, a1=0, a2=0, a3=0) -> int or None: fn(&v, a1, a2, a3); v if it returned 0, else None"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tandem_fastcall", NULL, -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__tandem_fastcall(void) { return PyModule_Create(&module); }
