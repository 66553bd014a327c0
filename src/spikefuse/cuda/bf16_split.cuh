// spikefuse bf16 split: n float32 values -> three bfloat16 terms each, hi + mid + lo, one pass.
//
// spikefuse/cuda/bf16_split.py compiles this file once, after a prelude that defines
// BLOCK_THREADS and UNROLL (threads per block, values per thread) and SPLIT_KERNEL (the entry
// point's name).
//
// hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid), each rounded to nearest. Both
// subtractions are exact in float32 (each term is the float nearest its remainder at 8 bits, so
// the remainder and the term are within a factor 2: Sterbenz), so hi + mid + lo is v to within
// half a bf16 ulp of the last remainder, about 2^-26 |v|: finer than float32's own rounding of
// a product. A NaN gives NaN in all three terms, an infinity NaN in mid and lo, and a finite
// value past bf16's largest (3.39e38) hi = +-inf and mid = -+inf: a matmul over the terms gives
// NaN there, never a finite result.
//
// out is [3, n] (hi of every value, then mid, then lo); thread t of a block handles values t,
// t + BLOCK_THREADS, ... (coalesced; UNROLL loads in flight before any is used).

#include <cuda_bf16.h>

struct Args {
    const float* values;    // [n]
    __nv_bfloat16* terms;   // [3, n]
    long long n;
};

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) SPLIT_KERNEL(const Args a) {
    const long long base = (long long)blockIdx.x * BLOCK_THREADS * UNROLL + threadIdx.x;
    float v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const long long i = base + (long long)u * BLOCK_THREADS;
        v[u] = i < a.n ? a.values[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const long long i = base + (long long)u * BLOCK_THREADS;
        if (i < a.n) {
            const __nv_bfloat16 hi = __float2bfloat16_rn(v[u]);
            const float rest = v[u] - __bfloat162float(hi);
            const __nv_bfloat16 mid = __float2bfloat16_rn(rest);
            a.terms[i] = hi;
            a.terms[a.n + i] = mid;
            a.terms[2 * a.n + i] = __float2bfloat16_rn(rest - __bfloat162float(mid));
        }
    }
}
