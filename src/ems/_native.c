/*
 * ems._native: the bulk copy of ems.
 *
 *   copy(dst, src, n)                       (a Python function, METH_FASTCALL)
 *
 * copies one run of n bytes from address src to address dst: every V0 copy and the
 * bench's limit. Called from Python directly, not through ctypes: a 4 KiB copy cost
 * ~0.1 us of call against ctypes' ~0.5-1.1 us (of a ~12 us embedded save, on the
 * 2-vCPU VM). The GIL is released for runs of at least EMS_NOGIL_MIN bytes (their copy
 * outlasts the release, and other threads copy meanwhile); smaller ones keep it.
 *
 *   void ems_copy_runs(const int64_t *dst, const int64_t *src, const int64_t *len,
 *                      int64_t n, int64_t same_len)   (a C symbol, called through ctypes,
 *                                                      which releases the GIL)
 *
 * copies n runs of bytes, run i from address src[i] to address dst[i], of len[i]
 * bytes (or len[0] bytes each when same_len != 0). The V1 mover computes every run of
 * a request with a few vectorised ops (all registered tensors at once), then moves
 * them in one call per 16 MiB, straight between the caller's memory and pool memory
 * (torch's gather + scatter would need two passes through a temporary, and a foreign
 * call per run costs ~2 us of Python).
 *
 *   checksums(tenant, keys, seqs, values)   (a Python function, METH_FASTCALL)
 *
 * the disk records' checksums (ems.disk.records.checksum: XXH3-64 of the record's
 * identity, its tenant and key, then its value) of a whole batch in one call, hashed
 * with the GIL released: ~1.3 -> ~0.5 us a 4 KiB record (a scan verifies every record
 * it finds), ~2.4 -> ~1.6 us a 16 KiB record of which ~0.1 with the GIL held (the
 * daemon's writers share one interpreter with its loop). XXH3 is the xxHash library's
 * own (src/ems/xxhash.h, v0.8.2, BSD 2-Clause, inlined), with AVX2 where the CPU has it
 * (_checksums.h, _native_avx2.c).
 *
 * When the module cannot be built (no compiler at install), ems falls back to torch
 * (V1) and ctypes.memmove (V0), and to the xxhash package for checksums.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#define EMS_CHECKSUMS ems_checksums_base
#include "_checksums.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
void ems_checksums_avx2(const char *tenant, uint16_t tenant_len, const char *const *keys,
                        const uint16_t *klens, const uint64_t *seqs, const void *const *vals,
                        const uint64_t *vlens, int64_t n, uint64_t *out);
#define EMS_HAVE_AVX2_BUILD 1
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

/* Runs of at least this many bytes are written with non-temporal (streaming) stores:
 * the KV runs of one request are scattered over the pool in pieces of tens of KiB,
 * below the size at which the C library's memcpy switches to streaming stores, and a
 * plain store first reads every destination line (read-for-ownership), costing about
 * half the bandwidth. */
#define EMS_STREAM_MIN 4096

/* At the start of every destination page the copy prefetches one line of the next
 * page (a prefetch never faults, past the end of a mapping neither), so that page's
 * address translation is done before the first streaming store reaches it. Where the
 * destination has 4 KiB pages (a daemon's memfd: shared memory gets no transparent
 * huge pages while the host's shmem_enabled is "never"; a torch KV cache) a streaming
 * store that misses the TLB stalls the stream: on the 2-vCPU EPYC VM, 1 MiB runs into
 * a memfd ran 13-14 GB/s without it and 18-20 with it, as fast as into huge-page
 * memory (which it does not slow down); V1 loads of 32 KiB blocks into a torch cache
 * 12 -> 15 GB/s (benchmarks/copy_probe.py). */
#define EMS_PAGE 4096
/* (through an integer: the address may lie past the end of the caller's object) */
#define EMS_PREFETCH_NEXT_PAGE(d) \
    _mm_prefetch((const char *)((uintptr_t)(d) + EMS_PAGE), _MM_HINT_T0)

static void copy_one(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    if (n >= EMS_STREAM_MIN) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        EMS_PREFETCH_NEXT_PAGE(d);
        size_t blocks = n / 64;
        for (size_t i = 0; i < blocks; i++) {
            if (((uintptr_t)d & (EMS_PAGE - 1)) < 64)
                EMS_PREFETCH_NEXT_PAGE(d);
            __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)(d + 0), a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
            s += 64; d += 64;
        }
        memcpy(d, s, n - blocks * 64);
        return;
    }
#endif
    memcpy(d, s, n);
}

void ems_copy_runs(const int64_t *dst, const int64_t *src, const int64_t *len,
                   int64_t n, int64_t same_len) {
    for (int64_t i = 0; i < n; i++) {
        size_t nbytes = (size_t)(same_len ? len[0] : len[i]);
        copy_one((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], nbytes);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are visible before the caller publishes */
#endif
}

void ems_copy(int64_t dst, int64_t src, int64_t n) {
    copy_one((char *)(intptr_t)dst, (const char *)(intptr_t)src, (size_t)n);
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Runs at least this long are copied without the GIL. */
#define EMS_NOGIL_MIN (64 * 1024)

static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src, n) takes 3 ints");
        return NULL;
    }
    long long d = PyLong_AsLongLong(args[0]);
    long long s = PyLong_AsLongLong(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    if ((d == -1 || s == -1 || n == -1) && PyErr_Occurred())
        return NULL;
    if (d <= 0 || s <= 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: addresses must be > 0 and n >= 0");
        return NULL;
    }
    if (n >= EMS_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        ems_copy((int64_t)d, (int64_t)s, (int64_t)n);
        Py_END_ALLOW_THREADS
    } else {
        ems_copy((int64_t)d, (int64_t)s, (int64_t)n);
    }
    Py_RETURN_NONE;
}

/* checksums(tenant: bytes, keys: list[bytes], seqs: sequence of int, values: list of
 * buffers) -> list[int]: each record's checksum (_checksums.h), hashed without the GIL. */
static PyObject *py_checksums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyBytes_Check(args[0]) || !PyList_Check(args[1])
            || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "checksums(tenant: bytes, keys: list, seqs, values: list)");
        return NULL;
    }
    PyObject *tenant = args[0], *values = args[3];
    /* a copy of the list of keys: the hashing reads them without the GIL */
    PyObject *keys = PyList_GetSlice(args[1], 0, PyList_GET_SIZE(args[1]));
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), got = 0;
    PyObject *seqs = PySequence_Fast(args[2], "checksums: seqs must be a sequence");
    if (seqs == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    PyObject *result = NULL;
    size_t m = n ? (size_t)n : 1;
    Py_buffer *bufs = PyMem_Calloc(m, sizeof(Py_buffer));
    const char **kp = PyMem_Malloc(m * sizeof(char *));
    const void **vp = PyMem_Malloc(m * sizeof(void *));
    uint16_t *kl = PyMem_Malloc(m * sizeof(uint16_t));
    uint64_t *seq = PyMem_Malloc(m * sizeof(uint64_t));
    uint64_t *vl = PyMem_Malloc(m * sizeof(uint64_t));
    uint64_t *out = PyMem_Malloc(m * sizeof(uint64_t));
    Py_ssize_t tl = PyBytes_GET_SIZE(tenant);
    if (bufs == NULL || kp == NULL || vp == NULL || kl == NULL || seq == NULL || vl == NULL
            || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyList_GET_SIZE(values) != n || PySequence_Fast_GET_SIZE(seqs) != n) {
        PyErr_SetString(PyExc_ValueError, "checksums: keys, seqs and values differ in length");
        goto done;
    }
    if (tl > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "checksums: the tenant must be < 64 KiB");
        goto done;
    }
    for (; got < n; got++) {
        PyObject *k = PyList_GET_ITEM(keys, got);
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) > 0xFFFF) {
            PyErr_SetString(PyExc_TypeError, "checksums: keys must be bytes of < 64 KiB");
            goto done;
        }
        kp[got] = PyBytes_AS_STRING(k);  /* (bytes: immutable, held by the copy) */
        kl[got] = (uint16_t)PyBytes_GET_SIZE(k);
        seq[got] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seqs, got));
        if (seq[got] == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        if (PyObject_GetBuffer(PyList_GET_ITEM(values, got), &bufs[got], PyBUF_SIMPLE) < 0)
            goto done;
        vp[got] = bufs[got].buf;
        vl[got] = (uint64_t)bufs[got].len;
    }
    const char *tb = PyBytes_AS_STRING(tenant);
    Py_BEGIN_ALLOW_THREADS
#ifdef EMS_HAVE_AVX2_BUILD
    if (__builtin_cpu_supports("avx2"))
        ems_checksums_avx2(tb, (uint16_t)tl, kp, kl, seq, vp, vl, n, out);
    else
#endif
        ems_checksums_base(tb, (uint16_t)tl, kp, kl, seq, vp, vl, n, out);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(out[i]);
        if (v == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(kp);
    PyMem_Free(vp);
    PyMem_Free(kl);
    PyMem_Free(seq);
    PyMem_Free(vl);
    PyMem_Free(out);
    Py_DECREF(seqs);
    Py_DECREF(keys);
    return result;
}

static PyMethodDef ems_native_methods[] = {
    {"checksums", (PyCFunction)(void (*)(void))py_checksums, METH_FASTCALL,
     "checksums(tenant, keys, seqs, values): the disk records' XXH3-64 checksums."},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes from address src to address dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ems_native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Bulk copy of byte runs for ems (see src/ems/_native.c).", -1, ems_native_methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&ems_native_module); }
