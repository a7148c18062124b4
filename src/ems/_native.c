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
 *   scan_batches(buf, rel, window, tenant, buf_at, keys, offsets, sizes, seqs,
 *                checksums)                 (a Python function, METH_FASTCALL)
 *
 * a recovery scan's step over the batches that lie whole in its read buffer: each
 * head parsed and checked by the rules of ems.disk.records.parse_batch_head, every
 * record's checksum computed (as checksums above) and compared, the good ones appended
 * to the scan's columns; it stops at the first head it does not take and the Python
 * step takes that one (garbage, another tenant's, a batch past the buffer). Without
 * the GIL but for making the keys and ints: a scan of 4 KiB records saved one at a
 * time cost ~4.8-6.6 us a record in Python (best of 5, CPU), ~2.0-3.0 this way.
 *
 *   encode_batch(tenant, keys, first_seq, values, offsets, span)
 *   index_commit(entries, keys, sizes, first_seq, offsets, sums, region)
 *                                           (Python functions, METH_FASTCALL)
 *
 * a disk writer's per-record steps of one batch: its head with the records' checksums
 * (hashed without the GIL), and the index's packed entries set in its dict (see each
 * below; a 16 KiB spill through ems-server --disk, 2-vCPU VM: ~0.1 + ~0.15 us of the
 * interpreter lock a value less, 67.9 -> 69.4 thousand values a second, medians of six
 * alternating pairs).
 *
 * When the module cannot be built (no compiler at install), ems falls back to torch
 * (V1) and ctypes.memmove (V0), to the xxhash package for checksums, to a head at a
 * time in Python for the scan, and to Python loops for a writer's head and entries.
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

/* The records' checksums (_checksums.h), by the AVX2 build where the CPU has it. */
static void checksums_any(const char *tenant, uint16_t tenant_len, const char *const *keys,
                          const uint16_t *klens, const uint64_t *seqs,
                          const void *const *vals, const uint64_t *vlens, int64_t n,
                          uint64_t *out) {
#ifdef EMS_HAVE_AVX2_BUILD
    if (__builtin_cpu_supports("avx2")) {
        ems_checksums_avx2(tenant, tenant_len, keys, klens, seqs, vals, vlens, n, out);
        return;
    }
#endif
    ems_checksums_base(tenant, tenant_len, keys, klens, seqs, vals, vlens, n, out);
}

/* A batch's columns, hashed without the GIL: each record's key (bytes, held by the
 * caller's copy of the list), its value's buffer (held until cols_free), its sequence
 * number and, after cols_hash, its checksum. */
typedef struct {
    Py_ssize_t n, got;  /* records; values taken so far */
    Py_buffer *bufs;
    const char **kp;
    const void **vp;
    uint16_t *kl;
    uint64_t *seq, *vl, *out;
} Cols;

static int cols_alloc(Cols *c, Py_ssize_t n) {
    size_t m = n ? (size_t)n : 1;
    c->n = n;
    c->got = 0;
    c->bufs = PyMem_Calloc(m, sizeof(Py_buffer));
    c->kp = PyMem_Malloc(m * sizeof(char *));
    c->vp = PyMem_Malloc(m * sizeof(void *));
    c->kl = PyMem_Malloc(m * sizeof(uint16_t));
    c->seq = PyMem_Malloc(m * sizeof(uint64_t));
    c->vl = PyMem_Malloc(m * sizeof(uint64_t));
    c->out = PyMem_Malloc(m * sizeof(uint64_t));
    if (c->bufs == NULL || c->kp == NULL || c->vp == NULL || c->kl == NULL
            || c->seq == NULL || c->vl == NULL || c->out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The next record's key (bytes of < 64 KiB) and value; -1 with an exception set. */
static int cols_take(Cols *c, PyObject *key, PyObject *value, const char *fn) {
    Py_ssize_t i = c->got;
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > 0xFFFF) {
        PyErr_Format(PyExc_TypeError, "%s: keys must be bytes of < 64 KiB", fn);
        return -1;
    }
    c->kp[i] = PyBytes_AS_STRING(key);
    c->kl[i] = (uint16_t)PyBytes_GET_SIZE(key);
    if (PyObject_GetBuffer(value, &c->bufs[i], PyBUF_SIMPLE) < 0)
        return -1;
    c->vp[i] = c->bufs[i].buf;
    c->vl[i] = (uint64_t)c->bufs[i].len;
    c->got++;
    return 0;
}

static void cols_hash(Cols *c, PyObject *tenant) {
    const char *tb = PyBytes_AS_STRING(tenant);
    uint16_t tl = (uint16_t)PyBytes_GET_SIZE(tenant);
    Py_BEGIN_ALLOW_THREADS
    checksums_any(tb, tl, c->kp, c->kl, c->seq, c->vp, c->vl, c->n, c->out);
    Py_END_ALLOW_THREADS
}

static void cols_free(Cols *c) {
    for (Py_ssize_t i = 0; i < c->got; i++)
        PyBuffer_Release(&c->bufs[i]);
    PyMem_Free(c->bufs);
    PyMem_Free((void *)c->kp);
    PyMem_Free((void *)c->vp);
    PyMem_Free(c->kl);
    PyMem_Free(c->seq);
    PyMem_Free(c->vl);
    PyMem_Free(c->out);
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
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *seqs = PySequence_Fast(args[2], "checksums: seqs must be a sequence");
    if (seqs == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    PyObject *result = NULL;
    Cols c;
    if (cols_alloc(&c, n) < 0)
        goto done;
    if (PyList_GET_SIZE(values) != n || PySequence_Fast_GET_SIZE(seqs) != n) {
        PyErr_SetString(PyExc_ValueError, "checksums: keys, seqs and values differ in length");
        goto done;
    }
    if (PyBytes_GET_SIZE(tenant) > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "checksums: the tenant must be < 64 KiB");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        c.seq[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seqs, i));
        if ((c.seq[i] == (uint64_t)-1 && PyErr_Occurred())
                || cols_take(&c, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(values, i),
                             "checksums") < 0)
            goto done;
    }
    cols_hash(&c, tenant);
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c.out[i]);
        if (v == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, v);
    }
done:
    cols_free(&c);
    Py_DECREF(seqs);
    Py_DECREF(keys);
    return result;
}

/* ------------------------------------------------------------------ scan_batches
 *
 * The batch format of ems.disk.records (version 2), little-endian:
 *   fixed  "<4sHHIIIQH": magic "EMSB", version 2, flags 0, hcrc, count, head_len,
 *          span, tl; then the tenant (tl bytes);
 *   entry  "<IQQQH": offset in the batch, seq, value length, checksum, kl; then the key
 *          (kl bytes), count entries back to back up to head_len;
 *   hcrc   CRC-32 (zlib's) of the head's head_len bytes with hcrc zeroed. */
#define EMS_FIXED 30
#define EMS_ENTRY 30
#define EMS_HCRC_AT 8
#define EMS_ALIGN 4096
#define EMS_MAX_NAME (EMS_ALIGN - EMS_FIXED - EMS_ENTRY)

static uint32_t crc_table[256];
/* the CRC of a head's first 12 bytes with hcrc zeroed, as every head starts */
static uint32_t crc_lead;
static uint32_t crc_update(uint32_t crc, const unsigned char *p, size_t n);

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
    static const unsigned char lead[12] = {'E', 'M', 'S', 'B', 2, 0, 0, 0, 0, 0, 0, 0};
    crc_lead = crc_update(0, lead, sizeof lead);
}

/* zlib.crc32(p[:n], crc) */
static uint32_t crc_update(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    for (size_t i = 0; i < n; i++)
        crc = crc_table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* The records of the heads taken so far, as columns (grown by doubling). */
typedef struct {
    Py_ssize_t n, cap;
    const char **kp;
    uint16_t *kl;
    uint64_t *seq, *vl, *want, *got, *at;
    const void **vp;
} Recs;

static int recs_grow(Recs *r) {
    Py_ssize_t cap = r->cap ? 2 * r->cap : 256;
#define EMS_GROW(f)                                                            \
    do {                                                                       \
        void *q = PyMem_RawRealloc((void *)r->f, (size_t)cap * sizeof *r->f);  \
        if (q == NULL)                                                         \
            return -1;                                                         \
        r->f = q;                                                              \
    } while (0)
    EMS_GROW(kp);
    EMS_GROW(kl);
    EMS_GROW(seq);
    EMS_GROW(vl);
    EMS_GROW(want);
    EMS_GROW(got);
    EMS_GROW(at);
    EMS_GROW(vp);
#undef EMS_GROW
    r->cap = cap;
    return 0;
}

static void recs_free(Recs *r) {
    PyMem_RawFree((void *)r->kp); PyMem_RawFree(r->kl); PyMem_RawFree(r->seq);
    PyMem_RawFree(r->vl); PyMem_RawFree(r->want); PyMem_RawFree(r->got);
    PyMem_RawFree(r->at); PyMem_RawFree((void *)r->vp);
}

/* One head at b[0..avail): its records appended to recs (at file offset base), and the
 * bytes its batch spans; 0 when it is not a valid head of the tenant wholly in the
 * buffer with every value in it too (ems.disk.records.parse_batch_head's rules, but
 * for the keys' UTF-8, checked when they are decoded), -1 when out of memory. */
static int64_t take_head(const unsigned char *b, uint64_t avail, const char *tb, uint16_t tl,
                         uint64_t base, Recs *recs) {
    if (avail < (uint64_t)EMS_FIXED + tl + EMS_ENTRY)
        return 0;
    uint32_t count = rd32(b + 12), head_len = rd32(b + 16);
    uint64_t span = rd64(b + 20);
    if (memcmp(b, "EMSB", 4) != 0 || rd16(b + 4) != 2 || rd16(b + 6) != 0
            || rd16(b + 28) != tl || memcmp(b + EMS_FIXED, tb, tl) != 0 || count < 1
            || head_len < (uint64_t)EMS_FIXED + tl + EMS_ENTRY || span % EMS_ALIGN
            || span < head_len || avail < head_len || span > ((uint64_t)1 << 62))
        return 0;  /* (a span past 2^62: the caller's step, which has no overflow) */
    if (crc_update(crc_lead, b + EMS_HCRC_AT + 4, head_len - EMS_HCRC_AT - 4)
            != rd32(b + EMS_HCRC_AT))
        return 0;
    Py_ssize_t first = recs->n;
    uint64_t pos = EMS_FIXED + (uint64_t)tl, end = head_len, prev_end = head_len;
    for (uint32_t i = 0; i < count; i++) {
        if (pos + EMS_ENTRY > end)
            goto bad;
        const unsigned char *e = b + pos;
        uint64_t off = rd32(e), vlen = rd64(e + 12);
        uint16_t kl = rd16(e + 28);
        pos += EMS_ENTRY;
        /* each value after the head and the value before it, and inside the batch
         * (its end <= span: as the last one's must be, the ends being in order) */
        if (pos + kl > end || (uint64_t)tl + kl > EMS_MAX_NAME || off < prev_end
                || vlen > span || off > span - vlen)
            goto bad;
        prev_end = off + vlen;
        if (recs->n == recs->cap && recs_grow(recs) < 0) {
            recs->n = first;
            return -1;
        }
        Py_ssize_t j = recs->n++;
        recs->kp[j] = (const char *)b + pos;
        recs->kl[j] = kl;
        recs->seq[j] = rd64(e + 4);
        recs->vl[j] = vlen;
        recs->want[j] = rd64(e + 20);
        recs->at[j] = base + off;
        recs->vp[j] = b + off;
        pos += kl;
    }
    if (pos != end || prev_end > avail)  /* entries to head_len exactly; values in here */
        goto bad;
    return (int64_t)span;
bad:
    recs->n = first;
    return 0;
}

/* scan_batches(buf, rel, window, tenant: bytes, buf_at, keys, offsets, sizes, seqs,
 *              checksums) -> (rel, damaged)
 *
 * ems.disk.recovery.scan_region's step over the batches that lie whole in its read
 * buffer: from offset rel of buf (the file's bytes from buf_at on), while at least
 * window bytes are left, each batch head of the tenant is parsed and checked, the
 * checksum of each of its records computed, and those that match appended to the five
 * lists (key, file offset, value length, seq, checksum); the others are counted
 * damaged. It stops at the first head it does not take (not a valid head of the
 * tenant, a key not UTF-8, or its batch's values not all in the buffer: the caller's
 * own step takes it from there) and returns where, and how many were damaged. The
 * heads are parsed and the values hashed without the GIL. (A scan of records saved
 * one at a time, 4 KiB each: the Python step cost ~4.7 us a record, ~1.8 of it the
 * head's parse, on the 2-vCPU VM.) */
static PyObject *py_scan_batches(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10 || !PyBytes_Check(args[3]) || !PyList_Check(args[5])
            || !PyList_Check(args[6]) || !PyList_Check(args[7]) || !PyList_Check(args[8])
            || !PyList_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError, "scan_batches(buf, rel: int, window: int, "
                        "tenant: bytes, buf_at: int, keys, offsets, sizes, seqs, "
                        "checksums: list)");
        return NULL;
    }
    Py_ssize_t rel = PyLong_AsSsize_t(args[1]), window = PyLong_AsSsize_t(args[2]);
    unsigned long long buf_at = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t tl = PyBytes_GET_SIZE(args[3]);
    if (rel < 0 || window < EMS_FIXED || tl > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "scan_batches: rel >= 0, window >= 30, and a "
                        "tenant < 64 KiB");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *b = view.buf;
    Py_ssize_t len = view.len;
    const char *tb = PyBytes_AS_STRING(args[3]);
    Recs recs = {0};
    /* the heads taken: where each starts and its first record */
    Py_ssize_t nheads = 0, hcap = 0, *hrel = NULL, *hfirst = NULL;
    int oom = 0;
    Py_ssize_t r = rel;
    Py_BEGIN_ALLOW_THREADS
    while (r <= len - window) {
        Py_ssize_t before = recs.n;
        int64_t span = take_head(b + r, (uint64_t)(len - r), tb, (uint16_t)tl,
                                 buf_at + (uint64_t)r, &recs);
        if (span <= 0) {
            oom = span < 0;
            break;
        }
        if (nheads == hcap) {
            Py_ssize_t cap = hcap ? 2 * hcap : 64;
            Py_ssize_t *a = PyMem_RawRealloc(hrel, (size_t)cap * sizeof *a);
            if (a != NULL)
                hrel = a;
            Py_ssize_t *f = PyMem_RawRealloc(hfirst, (size_t)cap * sizeof *f);
            if (f != NULL)
                hfirst = f;
            if (a == NULL || f == NULL) {
                oom = 1;
                break;
            }
            hcap = cap;
        }
        hrel[nheads] = r;
        hfirst[nheads++] = before;
        r += (Py_ssize_t)span;  /* (span <= 2^62: no overflow) */
    }
    if (!oom && recs.n) {
        checksums_any(tb, (uint16_t)tl, recs.kp, recs.kl, recs.seq, recs.vp, recs.vl,
                      recs.n, recs.got);
    }
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t damaged = 0, stop = r;
    for (Py_ssize_t h = 0; h < nheads; h++) {
        Py_ssize_t lo = hfirst[h], hi = h + 1 < nheads ? hfirst[h + 1] : recs.n;
        PyObject *keys[64], **kv = keys;
        Py_ssize_t nk = hi - lo, bad = 0, decoded = 0;
        if (nk > 64 && (kv = PyMem_Malloc((size_t)nk * sizeof *kv)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (; decoded < nk; decoded++) {
            kv[decoded] = PyUnicode_DecodeUTF8(recs.kp[lo + decoded], recs.kl[lo + decoded],
                                               NULL);
            if (kv[decoded] == NULL)
                break;
        }
        int ok = decoded == nk;
        if (!ok) {  /* a key not UTF-8: not a valid head; the caller's step skips it */
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                for (Py_ssize_t i = 0; i < decoded; i++)
                    Py_DECREF(kv[i]);
                if (kv != keys)
                    PyMem_Free(kv);
                goto done;
            }
            PyErr_Clear();
        }
        for (Py_ssize_t i = 0; ok && i < nk; i++) {
            Py_ssize_t j = lo + i;
            if (recs.got[j] != recs.want[j]) {
                bad++;
                continue;
            }
            PyObject *cols[4] = {PyLong_FromUnsignedLongLong(recs.at[j]),
                                 PyLong_FromUnsignedLongLong(recs.vl[j]),
                                 PyLong_FromUnsignedLongLong(recs.seq[j]),
                                 PyLong_FromUnsignedLongLong(recs.want[j])};
            int err = cols[0] == NULL || cols[1] == NULL || cols[2] == NULL || cols[3] == NULL
                || PyList_Append(args[5], kv[i]) < 0 || PyList_Append(args[6], cols[0]) < 0
                || PyList_Append(args[7], cols[1]) < 0 || PyList_Append(args[8], cols[2]) < 0
                || PyList_Append(args[9], cols[3]) < 0;
            for (int c = 0; c < 4; c++)
                Py_XDECREF(cols[c]);
            if (err) {
                ok = -1;
                break;
            }
        }
        for (Py_ssize_t i = 0; i < decoded; i++)
            Py_DECREF(kv[i]);
        if (kv != keys)
            PyMem_Free(kv);
        if (ok < 0)
            goto done;
        if (!ok) {
            stop = hrel[h];
            break;
        }
        damaged += bad;
    }
    result = Py_BuildValue("(nn)", stop, damaged);
done:
    recs_free(&recs);
    PyMem_RawFree(hrel);
    PyMem_RawFree(hfirst);
    PyBuffer_Release(&view);
    return result;
}

/* encode_batch(tenant: bytes, keys: list[bytes], first_seq: int, values: list of
 *              buffers, offsets: list[int], span: int) -> (head: bytearray, sums: list)
 *
 * A batch's head in the format above (ems.disk.records.encode_batch_head), its records'
 * sequence numbers first_seq, first_seq + 1, ..., and their checksums (as checksums()
 * computes them, hashed without the GIL), in one call: the daemon's writers share one
 * interpreter with its event loop. A batch of 256 values of 16 KiB (2-vCPU VM, best of
 * 50): 1.08 us a value through checksums() and the head in Python, 0.97 this way (of
 * which the hashing without the GIL is 0.8). */
static PyObject *py_encode_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyBytes_Check(args[0]) || !PyList_Check(args[1])
            || !PyList_Check(args[3]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "encode_batch(tenant: bytes, keys: list, first_seq, "
                                         "values: list, offsets: list, span)");
        return NULL;
    }
    PyObject *tenant = args[0], *values = args[3], *offsets = args[4];
    PyObject *keys = PyList_GetSlice(args[1], 0, PyList_GET_SIZE(args[1]));
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), tl = PyBytes_GET_SIZE(tenant);
    unsigned long long first = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long span = PyLong_AsUnsignedLongLong(args[5]);
    PyObject *result = NULL, *head = NULL, *sums = NULL;
    Cols c;
    uint64_t *off = NULL;
    if (cols_alloc(&c, n) < 0 || PyErr_Occurred())
        goto done;
    if ((off = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n < 1 || PyList_GET_SIZE(values) != n || PyList_GET_SIZE(offsets) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "encode_batch: keys, values and offsets differ in length, or none");
        goto done;
    }
    if (tl > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "encode_batch: the tenant must be < 64 KiB");
        goto done;
    }
    uint64_t head_len = EMS_FIXED + (uint64_t)tl;
    for (Py_ssize_t i = 0; i < n; i++) {
        off[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(offsets, i));
        if (off[i] == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        if (off[i] > 0xFFFFFFFFu) {
            PyErr_SetString(PyExc_ValueError, "encode_batch: an offset past 4 GiB");
            goto done;
        }
        c.seq[i] = first + (uint64_t)i;
        if (cols_take(&c, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(values, i),
                      "encode_batch") < 0)
            goto done;
        head_len += EMS_ENTRY + c.kl[i];
    }
    if (head_len > 0xFFFFFFFFu || n > 0xFFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "encode_batch: the head is too long");
        goto done;
    }
    cols_hash(&c, tenant);
    head = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)head_len);
    sums = PyList_New(n);
    if (head == NULL || sums == NULL)
        goto done;
    unsigned char *h = (unsigned char *)PyByteArray_AS_STRING(head);
    uint16_t ver = 2, flags = 0, tl16 = (uint16_t)tl;
    uint32_t count = (uint32_t)n, hl = (uint32_t)head_len, zero = 0;
    uint64_t sp = span;
    memcpy(h, "EMSB", 4);
    memcpy(h + 4, &ver, 2);
    memcpy(h + 6, &flags, 2);
    memcpy(h + EMS_HCRC_AT, &zero, 4);
    memcpy(h + 12, &count, 4);
    memcpy(h + 16, &hl, 4);
    memcpy(h + 20, &sp, 8);
    memcpy(h + 28, &tl16, 2);
    memcpy(h + EMS_FIXED, PyBytes_AS_STRING(tenant), (size_t)tl);
    unsigned char *e = h + EMS_FIXED + tl;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t o = (uint32_t)off[i];
        memcpy(e, &o, 4);
        memcpy(e + 4, &c.seq[i], 8);
        memcpy(e + 12, &c.vl[i], 8);
        memcpy(e + 20, &c.out[i], 8);
        memcpy(e + 28, &c.kl[i], 2);
        memcpy(e + EMS_ENTRY, c.kp[i], c.kl[i]);
        e += EMS_ENTRY + c.kl[i];
        PyObject *v = PyLong_FromUnsignedLongLong(c.out[i]);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(sums, i, v);
    }
    uint32_t crc = crc_update(0, h, (size_t)head_len);
    memcpy(h + EMS_HCRC_AT, &crc, 4);
    result = PyTuple_Pack(2, head, sums);
done:
    cols_free(&c);
    PyMem_Free(off);
    Py_XDECREF(head);
    Py_XDECREF(sums);
    Py_DECREF(keys);
    return result;
}

/* The disk index's packed entry (ems.disk.index: a checksum in bits 0-63, the sequence
 * number in 64-111, the value's size in 112-151, its offset in its region file in
 * 152-191, the region from 192 on), as a Python int. INDEX_LAYOUT exports the bit
 * positions; the index uses index_commit only where they are its own. */
#define EMS_SEQ_AT 64
#define EMS_SIZE_AT 112
#define EMS_OFFSET_AT 152
#define EMS_REGION_AT 192

static PyObject *packed_entry(uint64_t region, uint64_t offset, uint64_t size, uint64_t seq,
                              uint64_t sum) {
    uint64_t limb[4] = {sum, seq | (size << 48), (size >> 16) | (offset << 24), region};
    unsigned char b[32];
    for (int i = 0; i < 4; i++)  /* little-endian limbs, whatever the host */
        for (int j = 0; j < 8; j++)
            b[8 * i + j] = (unsigned char)(limb[i] >> (8 * j));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(b, sizeof b, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray(b, sizeof b, 1, 0);
#endif
}

/* index_commit(entries: dict, keys: list[str], sizes: list[int], first_seq: int,
 *              offsets: list[int], sums: list[int], region: int) -> int
 *
 * ems.disk.index.DiskIndex.commit_batch's loop: each key's packed entry (its value of
 * sizes[i] bytes at offsets[i] of the region's file, sequence number first_seq + i,
 * checksum sums[i]) set in entries; returns the change in the bytes of the values
 * that entries map to (the new sizes less the sizes of the entries they replaced).
 * Everything is checked before entries changes. Batches of 256 into one index of
 * 131,072 keys (2-vCPU VM): 0.58 us an entry in Python (five big-int operations
 * each), 0.43 this way; the rest is the dict's own work and its misses in the cache. */
static PyObject *py_index_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 || !PyDict_Check(args[0]) || !PyList_Check(args[1])
            || !PyList_Check(args[2]) || !PyList_Check(args[4]) || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "index_commit(entries: dict, keys: list, sizes: list, "
                                         "first_seq, offsets: list, sums: list, region)");
        return NULL;
    }
    PyObject *entries = args[0], *keys = args[1], *sizes = args[2], *offsets = args[4];
    PyObject *sums = args[5];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    unsigned long long first = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long region = PyLong_AsUnsignedLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (PyList_GET_SIZE(sizes) != n || PyList_GET_SIZE(offsets) != n
            || PyList_GET_SIZE(sums) != n) {
        PyErr_SetString(PyExc_ValueError, "index_commit: the columns differ in length");
        return NULL;
    }
    if (first + (unsigned long long)n > ((uint64_t)1 << 48)) {
        PyErr_SetString(PyExc_ValueError, "index_commit: a sequence number past 48 bits");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* all checked first: nothing set on an error */
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(keys, i))) {
            PyErr_SetString(PyExc_TypeError, "index_commit: keys must be str");
            return NULL;
        }
        unsigned long long s = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sizes, i));
        unsigned long long o = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(offsets, i));
        PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sums, i));
        if (PyErr_Occurred())
            return NULL;
        if (s >> 40 || o >> 40) {
            PyErr_SetString(PyExc_ValueError, "index_commit: a size or offset past 40 bits");
            return NULL;
        }
    }
    long long delta = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        uint64_t s = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sizes, i));
        PyObject *old = PyDict_GetItemWithError(entries, key);  /* (borrowed) */
        if (old == NULL && PyErr_Occurred())
            return NULL;
        if (old != NULL) {  /* replaced: its size leaves the sum */
            PyObject *at = PyLong_FromLong(EMS_SIZE_AT);
            if (at == NULL)
                return NULL;
            PyObject *shifted = PyNumber_Rshift(old, at);
            Py_DECREF(at);
            if (shifted == NULL)
                return NULL;
            unsigned long long was = PyLong_AsUnsignedLongLongMask(shifted) & ((1ULL << 40) - 1);
            Py_DECREF(shifted);
            delta -= (long long)was;
        }
        PyObject *packed = packed_entry(
            region, PyLong_AsUnsignedLongLong(PyList_GET_ITEM(offsets, i)), s,
            first + (uint64_t)i, PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sums, i)));
        if (packed == NULL)
            return NULL;
        int bad = PyDict_SetItem(entries, key, packed);
        Py_DECREF(packed);
        if (bad < 0)
            return NULL;
        delta += (long long)s;
    }
    return PyLong_FromLongLong(delta);
}

static PyMethodDef ems_native_methods[] = {
    {"scan_batches", (PyCFunction)(void (*)(void))py_scan_batches, METH_FASTCALL,
     "scan_batches(buf, rel, window, tenant, buf_at, keys, offsets, sizes, seqs, "
     "checksums): a scan's step over the whole batches of its read buffer."},
    {"checksums", (PyCFunction)(void (*)(void))py_checksums, METH_FASTCALL,
     "checksums(tenant, keys, seqs, values): the disk records' XXH3-64 checksums."},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes from address src to address dst."},
    {"encode_batch", (PyCFunction)(void (*)(void))py_encode_batch, METH_FASTCALL,
     "encode_batch(tenant, keys, first_seq, values, offsets, span): a batch's head and "
     "its records' checksums."},
    {"index_commit", (PyCFunction)(void (*)(void))py_index_commit, METH_FASTCALL,
     "index_commit(entries, keys, sizes, first_seq, offsets, sums, region): the disk "
     "index's packed entries of a written batch; the change in value bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ems_native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Bulk copy of byte runs for ems (see src/ems/_native.c).", -1, ems_native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    PyObject *mod = PyModule_Create(&ems_native_module);
    if (mod == NULL)
        return NULL;
    PyObject *layout = Py_BuildValue("(iiii)", EMS_SEQ_AT, EMS_SIZE_AT, EMS_OFFSET_AT,
                                     EMS_REGION_AT);
    if (layout == NULL || PyModule_AddObject(mod, "INDEX_LAYOUT", layout) < 0) {
        Py_XDECREF(layout);  /* (AddObject takes the reference only when it succeeds) */
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
