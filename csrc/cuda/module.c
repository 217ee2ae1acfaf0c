/* module.c: the Python binding of the CUDA kernels, fastattn._cuda.
 *
 * Plain Python C API, no CUDA headers: every runtime call goes through the
 * wrappers of runtime.cu.  Device pointers travel as Python ints.  The
 * argument checking that names user arguments lives in fastattn/cuda.py; the
 * checks here only guard the C contract. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fastattn_cuda.h"

#ifndef FA_CUDA_ARCHS
#define FA_CUDA_ARCHS "unknown"
#endif
#ifndef FA_NVCC_VERSION
#define FA_NVCC_VERSION "unknown"
#endif

static PyObject *cuda_error(const char *what, int code)
{
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (CUDA error %d)", what, fa_cuda_error_string(code), code);
    return NULL;
}

static PyObject *py_device_count(PyObject *self, PyObject *args)
{
    int n = 0;
    (void)fa_cuda_device_count(&n); /* no driver or no device: 0 */
    return PyLong_FromLong(n);
}

static PyObject *py_device_count_error(PyObject *self, PyObject *args)
{
    int n = 0, e = fa_cuda_device_count(&n);
    if (e == 0) Py_RETURN_NONE;
    return PyUnicode_FromString(fa_cuda_error_string(e));
}

static PyObject *py_device_name(PyObject *self, PyObject *args)
{
    int dev = 0, major = 0, minor = 0, e;
    char name[256];
    if (!PyArg_ParseTuple(args, "|i", &dev)) return NULL;
    e = fa_cuda_device_name(dev, name, sizeof name, &major, &minor);
    if (e) return cuda_error("cudaGetDeviceProperties", e);
    return Py_BuildValue("(sii)", name, major, minor);
}

static PyObject *py_versions(PyObject *self, PyObject *args)
{
    int rt = 0, drv = 0;
    if (fa_cuda_runtime_version(&rt)) rt = 0;
    if (fa_cuda_driver_version(&drv)) drv = 0;
    return Py_BuildValue("(ii)", rt, drv);
}

static PyObject *py_malloc(PyObject *self, PyObject *args)
{
    unsigned long long n;
    void *ptr = NULL;
    int e;
    if (!PyArg_ParseTuple(args, "K", &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    e = fa_cuda_malloc(&ptr, (size_t)n);
    Py_END_ALLOW_THREADS
    if (e) return cuda_error("cudaMalloc", e);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ptr);
}

static PyObject *py_free(PyObject *self, PyObject *args)
{
    unsigned long long ptr;
    int e;
    if (!PyArg_ParseTuple(args, "K", &ptr)) return NULL;
    e = fa_cuda_free((void *)(uintptr_t)ptr);
    if (e) return cuda_error("cudaFree", e);
    Py_RETURN_NONE;
}

static PyObject *py_memcpy(PyObject *args, int htod)
{
    unsigned long long dst, src, n;
    int e;
    if (!PyArg_ParseTuple(args, "KKK", &dst, &src, &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    e = htod ? fa_cuda_memcpy_htod((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n)
             : fa_cuda_memcpy_dtoh((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    if (e) return cuda_error(htod ? "cudaMemcpy (host to device)" : "cudaMemcpy (device to host)", e);
    Py_RETURN_NONE;
}

static PyObject *py_memcpy_htod(PyObject *self, PyObject *args) { return py_memcpy(args, 1); }
static PyObject *py_memcpy_dtoh(PyObject *self, PyObject *args) { return py_memcpy(args, 0); }

static PyObject *py_synchronize(PyObject *self, PyObject *args)
{
    int e;
    Py_BEGIN_ALLOW_THREADS
    e = fa_cuda_synchronize();
    Py_END_ALLOW_THREADS
    if (e) return cuda_error("cudaDeviceSynchronize", e);
    Py_RETURN_NONE;
}

static PyObject *py_stream_synchronize(PyObject *self, PyObject *args)
{
    unsigned long long s;
    int e;
    if (!PyArg_ParseTuple(args, "K", &s)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    e = fa_cuda_stream_synchronize((uintptr_t)s);
    Py_END_ALLOW_THREADS
    if (e) return cuda_error("cudaStreamSynchronize", e);
    Py_RETURN_NONE;
}

/* ---- the call record -> fa_params ------------------------------------------
 *
 * The record is a dict or an object with attributes (fastattn.cuda passes a
 * dict) whose keys / attributes are fa_params field names.  FIELDS names
 * every field of fa_params once, with how it is read:
 *   FA_USE_REQUIRED     must be present; None for a NULL pointer;
 *   FA_USE_UNSUPPORTED  the GPU kernels lack it (fastattn_cuda.h): may be
 *                       absent; present, it must be None / 0 (else ValueError
 *                       naming it);
 *   FA_USE_IGNORED      a CPU-only setting (num_threads) or the geometry of an
 *                       unsupported field (bm_*): not read.
 * tests/cuda/cuda_emulator.py parses this table, so that the emulator reads records
 * exactly as this loop does; keep one FA_FIELD(...) per line. */
enum fa_field_type { FA_T_INT, FA_T_I64, FA_T_F64, FA_T_PTR };
enum fa_field_use { FA_USE_REQUIRED, FA_USE_UNSUPPORTED, FA_USE_IGNORED };

typedef struct fa_field {
    const char *name;
    size_t offset;
    int type, use;
} fa_field;

#define FA_FIELD(f, type, use) {#f, offsetof(fa_params, f), type, use}
static const fa_field FIELDS[] = {
    FA_FIELD(q_dtype, FA_T_INT, FA_USE_REQUIRED),
    FA_FIELD(k_dtype, FA_T_INT, FA_USE_REQUIRED),
    FA_FIELD(v_dtype, FA_T_INT, FA_USE_REQUIRED),
    FA_FIELD(o_dtype, FA_T_INT, FA_USE_REQUIRED),
    FA_FIELD(B, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(Hq, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(Hk, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(L, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(S, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(D, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(Dv, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(q, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(q_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(q_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(q_sl, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(k, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(k_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(k_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(k_sl, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(v, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(v_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(v_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(v_sl, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(o, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(o_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(o_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(o_sl, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(lse, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(lse_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(lse_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(lse_sl, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(k_scale, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(ks_sb, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(ks_sh, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(ks_sl, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(ks_sd, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(v_scale, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(vs_sb, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(vs_sh, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(vs_sl, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(vs_sd, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(mask_kind, FA_T_INT, FA_USE_REQUIRED),
    FA_FIELD(mask, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(m_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(m_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(m_sl, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(m_ss, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(scale, FA_T_F64, FA_USE_REQUIRED),
    FA_FIELD(causal, FA_T_INT, FA_USE_REQUIRED),
    FA_FIELD(window_left, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(window_right, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(softcap, FA_T_F64, FA_USE_REQUIRED),
    FA_FIELD(alibi, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(alibi_sb, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(alibi_sh, FA_T_I64, FA_USE_REQUIRED),
    FA_FIELD(sinks, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(q_lens, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(k_lens, FA_T_PTR, FA_USE_REQUIRED),
    FA_FIELD(cu_q, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(cu_k, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(block_table, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(bt_sb, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(page_size, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(bmask, FA_T_PTR, FA_USE_UNSUPPORTED),
    FA_FIELD(bm_sb, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(bm_sh, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(bm_si, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(bm_sj, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(bm_q, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(bm_k, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(num_threads, FA_T_INT, FA_USE_IGNORED),
    FA_FIELD(precision, FA_T_INT, FA_USE_UNSUPPORTED),
    FA_FIELD(dropout_p, FA_T_F64, FA_USE_UNSUPPORTED),
    FA_FIELD(dropout_seed, FA_T_I64, FA_USE_IGNORED),
    FA_FIELD(dropout_b0, FA_T_I64, FA_USE_IGNORED),
};
#undef FA_FIELD
#define NFIELDS ((Py_ssize_t)(sizeof FIELDS / sizeof FIELDS[0]))

static const char *const TYPE_NAMES[] = {"int", "int64", "float64", "pointer"};
static const char *const USE_NAMES[] = {"required", "unsupported", "ignored"};

/* The record's value of a field (new reference), or NULL: with an exception
 * set when reading failed, without one when the field is absent.  A dict is
 * read by key, anything else by attribute. */
static PyObject *record_get(PyObject *rec, const char *name)
{
    PyObject *v;
    if (PyDict_Check(rec)) {
        v = PyDict_GetItemString(rec, name); /* borrowed */
        Py_XINCREF(v);
        return v;
    }
    v = PyObject_GetAttrString(rec, name);
    if (!v && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
    return v;
}

/* Converts v to the field's C value at dst (0), or sets an exception naming
 * the field (-1).  *zero tells whether the value is None / 0 (the neutral
 * value an unsupported field may hold). */
static int convert_field(const fa_field *f, PyObject *v, void *dst, int *zero)
{
    if (f->type == FA_T_F64) {
        const double x = PyFloat_AsDouble(v);
        if (x == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            goto bad_type;
        }
        *zero = x == 0.0;
        memcpy(dst, &x, sizeof x);
        return 0;
    }
    if (f->type == FA_T_PTR && v == Py_None) {
        const void *null = NULL;
        *zero = 1;
        memcpy(dst, &null, sizeof null);
        return 0;
    }
    if (!PyLong_Check(v) && !PyIndex_Check(v)) goto bad_type;
    if (f->type == FA_T_PTR) {
        PyObject *n = PyNumber_Index(v);
        unsigned long long x;
        const void *ptr;
        if (!n) return -1;
        x = PyLong_AsUnsignedLongLong(n);
        Py_DECREF(n);
        if (x == (unsigned long long)-1 && PyErr_Occurred()) goto bad_range;
        ptr = (const void *)(uintptr_t)x;
        *zero = x == 0;
        memcpy(dst, &ptr, sizeof ptr);
        return 0;
    } else {
        PyObject *n = PyNumber_Index(v);
        long long x;
        if (!n) return -1;
        x = PyLong_AsLongLong(n);
        Py_DECREF(n);
        if (x == -1 && PyErr_Occurred()) goto bad_range;
        *zero = x == 0;
        if (f->type == FA_T_INT) {
            int xi;
            if (x < INT_MIN || x > INT_MAX) goto bad_range;
            xi = (int)x;
            memcpy(dst, &xi, sizeof xi);
        } else {
            int64_t x64 = (int64_t)x;
            memcpy(dst, &x64, sizeof x64);
        }
        return 0;
    }
bad_type:
    PyErr_Format(PyExc_TypeError, "attention record: %s must be %s%s, got %.100s", f->name,
                 f->type == FA_T_F64 ? "a float" : "an int", f->type == FA_T_PTR ? " (device pointer) or None" : "",
                 Py_TYPE(v)->tp_name);
    return -1;
bad_range:
    PyErr_Clear();
    PyErr_Format(PyExc_OverflowError, "attention record: %s is out of range for a C %s", f->name,
                 TYPE_NAMES[f->type]);
    return -1;
}

/* Fills *p from the record: 0, or -1 with an exception naming the field. */
static int params_from_record(PyObject *rec, fa_params *p)
{
    Py_ssize_t i;
    memset(p, 0, sizeof *p);
    for (i = 0; i < NFIELDS; i++) {
        const fa_field *f = &FIELDS[i];
        PyObject *v;
        int zero = 0, rc;
        if (f->use == FA_USE_IGNORED) continue;
        v = record_get(rec, f->name);
        if (!v) {
            if (PyErr_Occurred()) return -1;
            if (f->use == FA_USE_UNSUPPORTED) continue; /* absent: the neutral value (memset) */
            PyErr_Format(PyExc_KeyError, "attention record: missing field %s", f->name);
            return -1;
        }
        rc = convert_field(f, v, (char *)p + f->offset, &zero);
        Py_DECREF(v);
        if (rc) return -1;
        if (f->use == FA_USE_UNSUPPORTED && !zero) {
            PyErr_Format(PyExc_ValueError, "%s is not supported by the CUDA kernels (it must be %s)", f->name,
                         f->type == FA_T_PTR ? "None" : "0");
            return -1;
        }
    }
    return 0;
}

/* attention(record, stream=0) -> None.  record: a dict or an object holding
 * the fa_params fields (see FIELDS); stream: a cudaStream_t as int (0 or
 * None: the default stream).  The launch is asynchronous. */
static PyObject *py_attention(PyObject *self, PyObject *args)
{
    PyObject *rec, *stream_obj = Py_None;
    unsigned long long stream = 0;
    fa_params p;
    char err[512] = "";
    int rc;
    if (!PyArg_ParseTuple(args, "O|O", &rec, &stream_obj)) return NULL;
    if (stream_obj != Py_None) {
        stream = PyLong_AsUnsignedLongLong(stream_obj);
        if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    if (params_from_record(rec, &p)) return NULL;
    rc = fa_cuda_attention(&p, (uintptr_t)stream, err, sizeof err);
    if (rc != FA_OK) {
        PyErr_Format(PyExc_RuntimeError, "fastattn CUDA attention: %s", err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* PARAMS: ((name, type, use), ...) of FIELDS, for tests that compare it with
 * the emulator's reading of this file. */
static PyObject *params_table(void)
{
    PyObject *t = PyTuple_New(NFIELDS);
    Py_ssize_t i;
    if (!t) return NULL;
    for (i = 0; i < NFIELDS; i++) {
        PyObject *e = Py_BuildValue("(sss)", FIELDS[i].name, TYPE_NAMES[FIELDS[i].type], USE_NAMES[FIELDS[i].use]);
        if (!e) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, e);
    }
    return t;
}

static PyMethodDef methods[] = {
    {"device_count", py_device_count, METH_NOARGS, "Number of visible CUDA devices (0 without a driver)."},
    {"device_count_error", py_device_count_error, METH_NOARGS,
     "Why cudaGetDeviceCount failed, or None when it succeeded."},
    {"device_name", py_device_name, METH_VARARGS, "(name, major, minor) of device i."},
    {"versions", py_versions, METH_NOARGS, "(runtime, driver) versions as CUDA ints (0 when unknown)."},
    {"malloc", py_malloc, METH_VARARGS, "cudaMalloc(n) -> device pointer as int."},
    {"free", py_free, METH_VARARGS, "cudaFree(ptr)."},
    {"memcpy_htod", py_memcpy_htod, METH_VARARGS, "memcpy_htod(dst, src, n): host to device."},
    {"memcpy_dtoh", py_memcpy_dtoh, METH_VARARGS, "memcpy_dtoh(dst, src, n): device to host."},
    {"synchronize", py_synchronize, METH_NOARGS, "cudaDeviceSynchronize()."},
    {"stream_synchronize", py_stream_synchronize, METH_VARARGS, "cudaStreamSynchronize(stream)."},
    {"attention", py_attention, METH_VARARGS, "attention(record, stream=0): launch the kernel the fa_params record describes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_cuda", "fastattn CUDA kernels (see fastattn.cuda).", -1, methods,
};

PyMODINIT_FUNC PyInit__cuda(void)
{
    PyObject *m = PyModule_Create(&moduledef), *table;
    if (!m) return NULL;
    table = params_table();
    if (!table || PyModule_AddObject(m, "PARAMS", table)) {
        Py_XDECREF(table);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "BUILD_ARCHS", FA_CUDA_ARCHS) ||
        PyModule_AddStringConstant(m, "NVCC_VERSION", FA_NVCC_VERSION) ||
        PyModule_AddIntConstant(m, "MAX_HEAD_DIM", FA_CUDA_MAX_HEAD_DIM)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
