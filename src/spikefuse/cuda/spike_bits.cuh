// spikefuse spike packing: n binary values (0 or 1, NaN where a neuron's input was NaN) <-> 1 bit
// each, one pass over the values each way; and the unpacking of the bits the neuron kernels write.
//
// spikefuse/cuda/spike_bits.py compiles this file once per storage dtype, after a prelude that
// defines:
//   scalar_t, to_float, from_float   storage type (float, __half, __nv_bfloat16) and conversions
//   BLOCK_THREADS, UNROLL, VEC       threads per block, PACK_KERNEL's and UNPACK_KERNEL's
//                                    elements per thread (VEC: 16 bytes of values)
//   PACK_KERNEL, UNPACK_KERNEL       the names of the two entry points (at the end of this file)
//
// The packing (as spikefuse/fused/spike_bits.py's torch path writes it) of n values of `window`
// bits each: W = ceil(n window / 32) little-endian 32-bit words, the window bits from bit e window
// on holding element e (byte j of a 1-bit packing: elements 8 j .. 8 j + 7), the bits past the last
// element zero; then W flag bytes, flag w 1 when an element of word w was NaN. A value is the count
// of its set bits over `window`: binary spikes take 1 bit, the average of a k x k window of spikes
// (a pooled block's output, written by the neuron kernels) k² bits. Unpacking gives NaN in every
// element of a flagged word: the bits cannot say which element was NaN, and a NaN must not come
// back as a valid value (backward would then turn a NaN forward into finite gradients). PACK_KERNEL
// packs binary values (window 1).
//
// PACK_KERNEL: blocks of BLOCK_THREADS threads over BLOCK_THREADS * UNROLL consecutive elements,
// thread t handling elements t, t + BLOCK_THREADS, ... (coalesced; UNROLL loads in flight before
// any is used). A warp's 32 lanes hold 32 consecutive elements, so one __ballot_sync is one word.

// The one argument of both kernels (packed by spike_bits.py's ARGS; same field order).
struct Args {
    scalar_t* values;      // [n]: read by PACK_KERNEL, written by UNPACK_KERNEL
    unsigned int* words;   // [W]
    unsigned char* flags;  // [W]: a NaN among the word's elements
    long long n;
    long long window;      // bits per element: 1, or (UNPACK_KERNEL) k² of a k x k average
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
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        // Lanes of a warp agree on u and on whether their word exists (32-aligned groups), so
        // the whole warp takes part in every ballot it reaches.
        const long long word = (base + (long long)u * BLOCK_THREADS) >> 5;
        if (word < words) {
            const unsigned int bits = __ballot_sync(0xffffffffu, v[u] != 0.0f);
            const unsigned int nans = __ballot_sync(0xffffffffu, v[u] != v[u]);
            if ((threadIdx.x & 31) == 0) {
                a.words[word] = bits;
                a.flags[word] = nans != 0u;
            }
        }
    }
}

// UNPACK_KERNEL: each thread writes VEC consecutive values (16 bytes: one vector store; VEC
// window divides 32, so their bits come from one word), the last thread's tail one by one. The
// values' address must be 16-byte aligned (spike_bits.py allocates them).
static_assert(VEC * sizeof(scalar_t) == 16 && 32 % VEC == 0, "VEC: 16 bytes, within a word");
struct alignas(16) vector_t {
    scalar_t e[VEC];
};

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) UNPACK_KERNEL(const Args a) {
    const long long first = ((long long)blockIdx.x * BLOCK_THREADS + threadIdx.x) * VEC;
    if (first >= a.n) return;
    const int window = (int)a.window;
    const long long bit = first * window;
    const unsigned int bits = a.words[bit >> 5] >> (bit & 31);  // lanes share a word
    const bool poisoned = a.flags[bit >> 5] != 0;
    const unsigned int mask = (1u << window) - 1u;
    const float unit = 1.0f / (float)window;  // exact: window is a power of two
    const float nan = __int_as_float(0x7fc00000);
    if (first + VEC <= a.n) {
        vector_t out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float count = (float)__popc((bits >> (k * window)) & mask);
            out.e[k] = from_float(poisoned ? nan : count * unit);
        }
        *reinterpret_cast<vector_t*>(a.values + first) = out;
    } else {
        for (int k = 0; first + k < a.n; ++k) {
            const float count = (float)__popc((bits >> (k * window)) & mask);
            a.values[first + k] = from_float(poisoned ? nan : count * unit);
        }
    }
}
