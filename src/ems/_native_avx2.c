/* ems._native.checksums' loop with AVX2 enabled (see _checksums.h); x86 only. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2")
#define EMS_CHECKSUMS ems_checksums_avx2
#include "_checksums.h"
#endif
