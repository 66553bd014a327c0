// spikefuse 1-bit spike packing: n binary values (0 or 1, NaN where a neuron's input was NaN)
// <-> bits, one pass over the values each way.
//
// spikefuse/cuda/spike_bits.py compiles this file once per storage dtype, after a prelude that
// defines:
//   scalar_t, to_float, from_float   storage type (float, __half, __nv_bfloat16) and conversions
//   BLOCK_THREADS, UNROLL, VEC       threads per block, PACK_KERNEL's and UNPACK_KERNEL's
//                                    elements per thread (VEC: 16 bytes of values)
//   PACK_KERNEL, UNPACK_KERNEL       the names of the two entry points (at the end of this file)
//
// The packing (as spikefuse/fused/spike_bits.py's torch path writes it): ceil(n / 32) 32-bit
// words, bit b of word w = element 32 w + b (little-endian: byte j holds elements 8 j .. 8 j + 7),
// the bits past n zero; then one flag byte, 1 when any element was NaN. Unpacking a packing whose
// flag is set gives NaN in every element: 1 bit cannot say which element was NaN, and a NaN must
// not come back as a valid 0 or 1 (backward would then turn a NaN forward into finite gradients).
//
// PACK_KERNEL: blocks of BLOCK_THREADS threads over BLOCK_THREADS * UNROLL consecutive elements,
// thread t handling elements t, t + BLOCK_THREADS, ... (coalesced; UNROLL loads in flight before
// any is used). A warp's 32 lanes hold 32 consecutive elements, so one __ballot_sync is one word.

// The one argument of both kernels (packed by spike_bits.py's ARGS; same field order).
struct Args {
    scalar_t* values;      // [n]: read by PACK_KERNEL, written by UNPACK_KERNEL
    unsigned int* words;   // [ceil(n / 32)]
    unsigned char* flag;   // 1 byte: NaN packed. PACK_KERNEL only sets it: the caller zeroes it
    long long n;
};

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) PACK_KERNEL(const Args a) {
    const long long base = (long long)blockIdx.x * BLOCK_THREADS * UNROLL + threadIdx.x;
    const long long words = (a.n + 31) / 32;
    float v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const long long i = base + (long long)u * BLOCK_THREADS;
        v[u] = i < a.n ? to_float(a.values[i]) : 0.0f;
    }
    bool nan = false;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        // Lanes of a warp agree on u and on whether their word exists (32-aligned groups), so
        // the whole warp takes part in every ballot it reaches.
        const long long word = (base + (long long)u * BLOCK_THREADS) >> 5;
        if (word < words) {
            const unsigned int bits = __ballot_sync(0xffffffffu, v[u] != 0.0f);
            if ((threadIdx.x & 31) == 0) a.words[word] = bits;
        }
        nan |= v[u] != v[u];
    }
    if (__any_sync(0xffffffffu, nan) && (threadIdx.x & 31) == 0) *a.flag = 1;
}

// UNPACK_KERNEL: each thread writes VEC consecutive values (16 bytes: one vector store; VEC
// divides 32, so they come from one word), the last thread's tail one by one. The values'
// address must be 16-byte aligned (spike_bits.py allocates them).
static_assert(VEC * sizeof(scalar_t) == 16 && 32 % VEC == 0, "VEC: 16 bytes, within a word");
struct alignas(16) vector_t {
    scalar_t e[VEC];
};

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) UNPACK_KERNEL(const Args a) {
    const long long first = ((long long)blockIdx.x * BLOCK_THREADS + threadIdx.x) * VEC;
    if (first >= a.n) return;
    const float nan = __int_as_float(0x7fc00000);
    const bool poisoned = *a.flag != 0;
    const unsigned int bits = a.words[first >> 5] >> (first & 31);  // 8 or 4 lanes share a word
    if (first + VEC <= a.n) {
        vector_t out;
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            out.e[k] = from_float(poisoned ? nan : (float)((bits >> k) & 1u));
        *reinterpret_cast<vector_t*>(a.values + first) = out;
    } else {
        for (int k = 0; first + k < a.n; ++k)
            a.values[first + k] = from_float(poisoned ? nan : (float)((bits >> k) & 1u));
    }
}
