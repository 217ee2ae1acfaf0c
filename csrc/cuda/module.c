/* module.c: the Python binding of the CUDA kernels, fastattn._cuda.
 *
 * Plain Python C API, no CUDA headers: every runtime call goes through the
 * wrappers of attention.cu.  Device pointers travel as Python ints.  The
 * argument checking that names user arguments lives in fastattn/cuda.py; the
 * checks here only guard the C contract. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *py_get_device(PyObject *self, PyObject *args)
{
    int dev = 0, e = fa_cuda_get_device(&dev);
    if (e) return cuda_error("cudaGetDevice", e);
    return PyLong_FromLong(dev);
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

/* Dict field readers: 0 on success, -1 with a Python exception set. */
static PyObject *field(PyObject *d, const char *k)
{
    PyObject *v = PyDict_GetItemString(d, k); /* borrowed */
    if (!v) PyErr_Format(PyExc_KeyError, "attention params: missing %s", k);
    return v;
}

static int get_i64(PyObject *d, const char *k, int64_t *out)
{
    PyObject *v = field(d, k);
    long long x;
    if (!v) return -1;
    x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)x;
    return 0;
}

static int get_int(PyObject *d, const char *k, int *out)
{
    int64_t x;
    if (get_i64(d, k, &x)) return -1;
    if (x < INT32_MIN || x > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "attention params: %s out of range", k);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int get_f64(PyObject *d, const char *k, double *out)
{
    PyObject *v = field(d, k);
    double x;
    if (!v) return -1;
    x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

static int get_ptr(PyObject *d, const char *k, const void **out)
{
    PyObject *v = field(d, k);
    unsigned long long x;
    if (!v) return -1;
    if (v == Py_None) { *out = NULL; return 0; }
    x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (const void *)(uintptr_t)x;
    return 0;
}

/* attention(params: dict) -> None.  The keys are the fa_cuda_params field
 * names plus "stream" (a cudaStream_t as int, or None / 0 for the default
 * stream); the launch is asynchronous. */
static PyObject *py_attention(PyObject *self, PyObject *args)
{
    PyObject *d;
    fa_cuda_params p;
    const void *lse = NULL, *o = NULL, *alibi = NULL, *klens = NULL, *stream = NULL;
    char err[512] = "";
    int rc;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &d)) return NULL;
    memset(&p, 0, sizeof p);
    if (get_int(d, "q_dtype", &p.q_dtype) || get_int(d, "kv_dtype", &p.kv_dtype) ||
        get_i64(d, "B", &p.B) || get_i64(d, "Hq", &p.Hq) || get_i64(d, "Hk", &p.Hk) ||
        get_i64(d, "L", &p.L) || get_i64(d, "S", &p.S) || get_i64(d, "D", &p.D) || get_i64(d, "Dv", &p.Dv) ||
        get_ptr(d, "q", &p.q) || get_i64(d, "q_sb", &p.q_sb) || get_i64(d, "q_sh", &p.q_sh) ||
        get_i64(d, "q_sl", &p.q_sl) ||
        get_ptr(d, "k", &p.k) || get_i64(d, "k_sb", &p.k_sb) || get_i64(d, "k_sh", &p.k_sh) ||
        get_i64(d, "k_sl", &p.k_sl) ||
        get_ptr(d, "v", &p.v) || get_i64(d, "v_sb", &p.v_sb) || get_i64(d, "v_sh", &p.v_sh) ||
        get_i64(d, "v_sl", &p.v_sl) ||
        get_ptr(d, "o", &o) || get_i64(d, "o_sb", &p.o_sb) || get_i64(d, "o_sh", &p.o_sh) ||
        get_i64(d, "o_sl", &p.o_sl) ||
        get_ptr(d, "lse", &lse) || get_i64(d, "lse_sb", &p.lse_sb) || get_i64(d, "lse_sh", &p.lse_sh) ||
        get_i64(d, "lse_sl", &p.lse_sl) ||
        get_int(d, "mask_kind", &p.mask_kind) || get_ptr(d, "mask", &p.mask) ||
        get_i64(d, "m_sb", &p.m_sb) || get_i64(d, "m_sh", &p.m_sh) || get_i64(d, "m_sl", &p.m_sl) ||
        get_i64(d, "m_ss", &p.m_ss) ||
        get_f64(d, "scale", &p.scale) || get_int(d, "causal", &p.causal) ||
        get_i64(d, "window_left", &p.window_left) || get_i64(d, "window_right", &p.window_right) ||
        get_f64(d, "softcap", &p.softcap) ||
        get_ptr(d, "alibi", &alibi) || get_i64(d, "alibi_sb", &p.alibi_sb) ||
        get_i64(d, "alibi_sh", &p.alibi_sh) || get_ptr(d, "k_lens", &klens) || get_ptr(d, "stream", &stream))
        return NULL;
    p.o = (void *)o;
    p.lse = (float *)lse;
    p.alibi = (const double *)alibi;
    p.k_lens = (const int64_t *)klens;
    rc = fa_cuda_attention(&p, (uintptr_t)stream, err, sizeof err);
    if (rc != FA_OK) {
        PyErr_Format(PyExc_RuntimeError, "fastattn CUDA attention: %s", err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"device_count", py_device_count, METH_NOARGS, "Number of visible CUDA devices (0 without a driver)."},
    {"device_count_error", py_device_count_error, METH_NOARGS,
     "Why cudaGetDeviceCount failed, or None when it succeeded."},
    {"device_name", py_device_name, METH_VARARGS, "(name, major, minor) of device i."},
    {"get_device", py_get_device, METH_NOARGS, "The current device."},
    {"versions", py_versions, METH_NOARGS, "(runtime, driver) versions as CUDA ints (0 when unknown)."},
    {"malloc", py_malloc, METH_VARARGS, "cudaMalloc(n) -> device pointer as int."},
    {"free", py_free, METH_VARARGS, "cudaFree(ptr)."},
    {"memcpy_htod", py_memcpy_htod, METH_VARARGS, "memcpy_htod(dst, src, n): host to device."},
    {"memcpy_dtoh", py_memcpy_dtoh, METH_VARARGS, "memcpy_dtoh(dst, src, n): device to host."},
    {"synchronize", py_synchronize, METH_NOARGS, "cudaDeviceSynchronize()."},
    {"stream_synchronize", py_stream_synchronize, METH_VARARGS, "cudaStreamSynchronize(stream)."},
    {"attention", py_attention, METH_VARARGS, "Launch the attention kernel described by a params dict."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_cuda", "fastattn CUDA kernels (see fastattn.cuda).", -1, methods,
};

PyMODINIT_FUNC PyInit__cuda(void)
{
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "BUILD_ARCHS", FA_CUDA_ARCHS) ||
        PyModule_AddStringConstant(m, "NVCC_VERSION", FA_NVCC_VERSION) ||
        PyModule_AddIntConstant(m, "MAX_HEAD_DIM", FA_CUDA_MAX_HEAD_DIM) ||
        PyModule_AddIntConstant(m, "F32", FA_F32) || PyModule_AddIntConstant(m, "F16", FA_F16) ||
        PyModule_AddIntConstant(m, "BF16", FA_BF16) ||
        PyModule_AddIntConstant(m, "MASK_NONE", FA_MASK_NONE) ||
        PyModule_AddIntConstant(m, "MASK_BOOL", FA_MASK_BOOL) ||
        PyModule_AddIntConstant(m, "MASK_F32", FA_MASK_F32) ||
        PyModule_AddIntConstant(m, "MASK_F64", FA_MASK_F64)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
