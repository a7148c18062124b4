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
 * When the module cannot be built (no compiler at install), ems falls back to torch
 * (V1) and ctypes.memmove (V0).
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>
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

static PyMethodDef ems_native_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes from address src to address dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ems_native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Bulk copy of byte runs for ems (see src/ems/_native.c).", -1, ems_native_methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&ems_native_module); }
