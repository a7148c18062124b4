/*
 * The loop of ems._native.checksums (see _native.c), compiled twice: in _native.c for
 * the baseline of the build (SSE2 on x86-64) and in _native_avx2.c with AVX2 enabled,
 * chosen at run time by what the CPU has (XXH3 picks its vector code when compiled:
 * 1 MiB hashed in ~68 us with SSE2, ~33 with AVX2, on the 2-vCPU EPYC VM). Each
 * includes the xxHash library (xxhash.h, v0.8.2, BSD 2-Clause) inlined, all static.
 *
 * EMS_CHECKSUMS names the function. Per record i: XXH3-64 of (seqs[i], vlens[i],
 * tenant_len, klens[i]) packed little-endian as struct "<QQHH", then the tenant,
 * keys[i] and vals[i] (ems.disk.records.checksum).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include "xxhash.h"

void EMS_CHECKSUMS(const char *tenant, uint16_t tenant_len, const char *const *keys,
                   const uint16_t *klens, const uint64_t *seqs, const void *const *vals,
                   const uint64_t *vlens, int64_t n, uint64_t *out) {
    XXH3_state_t st;
    for (int64_t i = 0; i < n; i++) {
        unsigned char ident[20];
        memcpy(ident, &seqs[i], 8); /* little-endian hosts, as struct "<QQHH" */
        memcpy(ident + 8, &vlens[i], 8);
        memcpy(ident + 16, &tenant_len, 2);
        memcpy(ident + 18, &klens[i], 2);
        XXH3_64bits_reset(&st);
        XXH3_64bits_update(&st, ident, sizeof ident);
        XXH3_64bits_update(&st, tenant, tenant_len);
        XXH3_64bits_update(&st, keys[i], klens[i]);
        XXH3_64bits_update(&st, vals[i], (size_t)vlens[i]);
        out[i] = XXH3_64bits_digest(&st);
    }
}
