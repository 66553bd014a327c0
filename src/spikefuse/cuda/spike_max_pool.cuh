// spikefuse max pooling of [N, C, H, W] maps that keeps, for backward, one byte per output value:
// the position of the window's maximum in the window (its code, i * KW + j for the element at row
// offset i and column offset j), where ATen keeps an int64 index into the map.
//
// spikefuse/cuda/spike_max_pool.py compiles this file once per storage dtype and window, after a
// prelude that defines:
//   scalar_t, to_float, from_float   storage type (float, __half, __nv_bfloat16) and conversions
//   BLOCK_THREADS                    threads per block
//   VEC                              channels per thread of the vector kernels: 16 bytes of values
//   KH, KW, SH, SW, PH, PW, DH, DW   the window: kernel, stride, padding, dilation (rows, columns);
//                                    constants, so that dividing by them costs a multiply or shift
//   FORWARD_KERNEL, BACKWARD_KERNEL  the names of the four entry points (at the end of this file)
//   FORWARD_VECTOR_KERNEL, BACKWARD_VECTOR_KERNEL
//
// Each kernel is pool_forward<V> or pool_backward<V>: a thread handles V neighbouring channels of
// one position. The scalar kernels (V = 1) take any input strides and write NCHW or channels-last
// tensors; the vector kernels (V = VEC) run where the host found every tensor channels-last with
// channels adjacent, C and the other strides multiples of VEC, and the base addresses aligned
// (values: 16 bytes, codes: VEC bytes), so that each window element is one 16-byte load, the
// values one 16-byte store and the codes one VEC-byte store. Per channel the two compute the
// same operations in the same order: their results are identical bit for bit.
//
// FORWARD: one thread per V output values, threads in the output's memory order (channels
// innermost for a channels-last map: a warp reads neighbouring channels of one position,
// coalesced). It scans the window in ATen's order (rows, then columns), taking an element where
// it is greater than the maximum so far or NaN, from -inf and the window's first element inside
// the map: the first of equal maxima wins (of binary spikes: the first spike, else the first
// element), padded positions never do, as in ATen's max_pool2d on CPU and CUDA.
//
// BACKWARD: one thread per V input elements, in the input gradient's memory order: a gather.
// The element sums the gradients of the windows that contain it and whose code points at it, in
// float, windows in ascending (row, column) order, and writes the sum once: ATen's CUDA backward
// (p_start / p_end bound the windows whose span covers the element), without its int64 reads. A
// window's gradient is read only where its code points at one of the thread's elements.
// Deterministic, no atomics.
//
// Two options serve a fused block that max-pools its BatchNorm output (x = y) before the neuron
// (spikefuse/fused/ops/bn_neuron/passes.py): forward's per-channel `flip` makes the windows of
// channels whose BatchNorm scale is negative take their minimum (what the maximum of the BN
// output picks there), and backward's `coef_x`, `coef_0` add BatchNorm's batch-statistics terms
// at every element, so that one pass writes the block's dL/dy.

// Division by a divisor fixed at launch: a multiply-high and a shift (the host computes the magic
// number m and the shift s, as PyTorch's IntDivider does), exact for dividends below 2^31.
struct Divider {
    unsigned int d, m, s;
};

__device__ __forceinline__ unsigned int divide(unsigned int n, const Divider& q)
{
    return (__umulhi(n, q.m) + n) >> q.s;
}

// The one argument of both kernels (packed by spike_max_pool.py's ARGS; same field order).
struct Args {
    const scalar_t* x;          // forward: the input, any strides (x_stride)
    scalar_t* out;              // forward: the output, dense in the threads' order
    unsigned char* codes;       // forward: written like out (null: not kept); backward: read
    const scalar_t* grad_out;   // backward: dL/dout, any strides (grad_stride)
    scalar_t* grad_x;           // backward: dL/dx, dense in the threads' order
    const float* flip;          // forward: per channel; where negative, windows take their
                                // minimum (the maximum of -x; null: none)
    const float* coef_x;        // backward: per channel, dL/dx += coef_x x + coef_0 at every
    const float* coef_0;        // element (x read at x_stride; null: nothing added)
    long long n;                // threads: out's (forward), grad_x's (backward) elements / V
    long long x_stride[4];      // N, C, H, W strides in elements
    long long code_stride[4];
    long long grad_stride[4];
    Divider walked[3];          // C / V, H, W of the tensor the threads walk (out, or grad_x)
    int size[2];                // H, W of the input
    int pooled[2];              // OH, OW
    int channels_last;          // the threads' order: N, H, W, C (1) or N, C, H, W (0)
};

struct Position {
    int n, c, h, w;
};

// The coordinates of element i of a dense [N, C, height, width] tensor in the threads' order
// (dividers: C, height, width; C counts groups of V channels where a thread has V);
// index_t: unsigned int (fast division) below 2^31 elements.
template <typename index_t>
__device__ __forceinline__ Position position_of(index_t i, const Divider* d, int channels_last);

template <>
__device__ __forceinline__ Position position_of<unsigned int>(unsigned int i, const Divider* d,
                                                              int channels_last)
{
    Position p;
    const int inner = channels_last ? 0 : 2;  // the divider of the innermost dimension
    const int middle = channels_last ? 2 : 1;
    const int outer = channels_last ? 1 : 0;  // of the outermost but N
    unsigned int q = divide(i, d[inner]);
    const int first = (int)(i - q * d[inner].d);
    unsigned int r = divide(q, d[middle]);
    const int second = (int)(q - r * d[middle].d);
    q = divide(r, d[outer]);
    const int third = (int)(r - q * d[outer].d);
    p.n = (int)q;
    if (channels_last) {
        p.c = first, p.w = second, p.h = third;
    } else {
        p.w = first, p.h = second, p.c = third;
    }
    return p;
}

template <>
__device__ __forceinline__ Position position_of<long long>(long long i, const Divider* d,
                                                           int channels_last)
{
    Position p;
    const long long channels = d[0].d, height = d[1].d, width = d[2].d;
    if (channels_last) {
        p.c = (int)(i % channels);
        i /= channels;
        p.w = (int)(i % width);
        i /= width;
        p.h = (int)(i % height);
        p.n = (int)(i / height);
    } else {
        p.w = (int)(i % width);
        i /= width;
        p.h = (int)(i % height);
        i /= height;
        p.c = (int)(i % channels);
        p.n = (int)(i / channels);
    }
    return p;
}

__device__ __forceinline__ Position position(long long i, const Args& a)
{
    if (a.n < 0x80000000LL)
        return position_of<unsigned int>((unsigned int)i, a.walked, a.channels_last);
    return position_of<long long>(i, a.walked, a.channels_last);
}

// The address offset of map (n, c) in a tensor of these strides.
__device__ __forceinline__ long long map_offset(const long long* stride, int n, int c)
{
    return n * stride[0] + c * stride[1];
}

// The first offset i of a window starting at `start` whose element start + i * dilation lies
// inside the map (start >= -pad > -kernel * dilation, so one does).
__device__ __forceinline__ int first_inside(int start, int dilation)
{
    return start < 0 ? (-start + dilation - 1) / dilation : 0;
}

// V neighbouring channels of one position: one load or store (V = 1: one value).
template <int V>
struct alignas(sizeof(scalar_t) * V) Values {
    scalar_t e[V];
};

template <int V>
__device__ __forceinline__ Values<V> load_values(const scalar_t* p)
{
    return *reinterpret_cast<const Values<V>*>(p);
}

// The codes of V neighbouring channels as one word, channel k in byte k (little-endian, as the
// GPU and x86 store words): one load or store of V bytes.
template <int V>
struct CodeWord;
template <>
struct CodeWord<1> {
    typedef unsigned char type;
};
template <>
struct CodeWord<4> {
    typedef unsigned int type;
};
template <>
struct CodeWord<8> {
    typedef unsigned long long type;
};

template <int V>
__device__ __forceinline__ int code_of(const typename CodeWord<V>::type word, const int k)
{
    return (int)((word >> (8 * k)) & 0xff);
}

// Element v of the window (code `at`) replaces the maximum so far of each channel where it is
// greater or NaN: ATen's rule.
template <int V>
__device__ __forceinline__ void take_greater(float (&best)[V], Values<V>& value, int (&code)[V],
                                             const Values<V>& v, const int at,
                                             const unsigned int flipped)
{
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const float f = (flipped >> k) & 1u ? -to_float(v.e[k]) : to_float(v.e[k]);
        if (f > best[k] || f != f) {
            best[k] = f;
            value.e[k] = v.e[k];
            code[k] = at;
        }
    }
}

template <int V>
__device__ __forceinline__ void pool_forward(const Args& a)
{
    const long long i = (long long)blockIdx.x * BLOCK_THREADS + threadIdx.x;
    if (i >= a.n) return;
    const Position p = position(i, a);  // p.c: the channel group, channels p.c * V + k
    const int h0 = p.h * SH - PH;
    const int w0 = p.w * SW - PW;
    const int i0 = first_inside(h0, DH);
    const int j0 = first_inside(w0, DW);
    const scalar_t* x = a.x + map_offset(a.x_stride, p.n, p.c * V);
    const float lowest = __int_as_float(0xff800000);  // -inf
    float best[V];
    Values<V> value;
    int code[V];
#pragma unroll
    for (int k = 0; k < V; ++k) best[k] = lowest, value.e[k] = from_float(lowest);
#pragma unroll
    for (int k = 0; k < V; ++k) code[k] = i0 * KW + j0;
    unsigned int flipped = 0;  // bit k: channel k's windows take their minimum
    if (a.flip != nullptr) {
#pragma unroll
        for (int k = 0; k < V; ++k) flipped |= (__ldg(a.flip + p.c * V + k) < 0.0f ? 1u : 0u) << k;
    }
#pragma unroll
    for (int ki = 0; ki < KH; ++ki) {
        const int h = h0 + ki * DH;
        if (ki < i0 || h >= a.size[0]) continue;
#pragma unroll
        for (int kj = 0; kj < KW; ++kj) {
            const int w = w0 + kj * DW;
            if (kj < j0 || w >= a.size[1]) continue;
            const Values<V> v = load_values<V>(x + h * a.x_stride[2] + w * a.x_stride[3]);
            take_greater<V>(best, value, code, v, ki * KW + kj, flipped);
        }
    }
    reinterpret_cast<Values<V>*>(a.out)[i] = value;
    if (a.codes == nullptr) return;
    typename CodeWord<V>::type word = 0;
#pragma unroll
    for (int k = 0; k < V; ++k) word |= (typename CodeWord<V>::type)code[k] << (8 * k);
    reinterpret_cast<typename CodeWord<V>::type*>(a.codes)[i] = word;
}

// ATen's range of windows (along one axis) whose span covers input coordinate `at`: [start, end).
template <int K, int S, int P, int D>
__device__ __forceinline__ int window_start(int at)
{
    constexpr int span = (K - 1) * D + 1;
    return at + P < span ? 0 : (at + P - span) / S + 1;
}

template <int S, int P>
__device__ __forceinline__ int window_end(int at, int pooled)
{
    const int end = (at + P) / S + 1;
    return end < pooled ? end : pooled;
}

// The offset of coordinate `at` in window `o` along one axis, or -1 where the window skips it
// (dilation) or ends before it.
template <int K, int S, int P, int D>
__device__ __forceinline__ int offset_in(int at, int o)
{
    const int d = at - (o * S - P);
    if (d < 0 || d % D != 0 || d / D >= K) return -1;
    return d / D;
}

// Adds the gradient of one window (at `grad`) to the channels whose code in `word` is `at`, the
// window's position of the thread's element; reads the gradient only where one is.
template <int V>
__device__ __forceinline__ void add_pointed(float (&sum)[V], const typename CodeWord<V>::type word,
                                            const int at, const scalar_t* grad)
{
    bool hit[V], any = false;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        hit[k] = code_of<V>(word, k) == at;
        any = any || hit[k];
    }
    if (!any) return;
    const Values<V> g = load_values<V>(grad);
#pragma unroll
    for (int k = 0; k < V; ++k)
        if (hit[k]) sum[k] += to_float(g.e[k]);
}

// One window at a time, its gradient loaded after its code. Loading every covering window's code
// first, then the pointed gradients, was measured on an H200 at the ResNet stem (3 x 3 / 2 over
// [128, 64, 112, 112], channels-last): float32 572 -> 406 us, bfloat16 304 -> 380 us (its eight
// channels per thread then need 60 registers instead of 40, fewer threads stay resident).
template <int V>
__device__ __forceinline__ void pool_backward(const Args& a)
{
    const long long i = (long long)blockIdx.x * BLOCK_THREADS + threadIdx.x;
    if (i >= a.n) return;
    const Position p = position(i, a);  // p.c: the channel group, channels p.c * V + k
    const int oh_end = window_end<SH, PH>(p.h, a.pooled[0]);
    const int ow_start = window_start<KW, SW, PW, DW>(p.w);
    const int ow_end = window_end<SW, PW>(p.w, a.pooled[1]);
    const unsigned char* codes = a.codes + map_offset(a.code_stride, p.n, p.c * V);
    const scalar_t* grad = a.grad_out + map_offset(a.grad_stride, p.n, p.c * V);
    float sum[V];
#pragma unroll
    for (int k = 0; k < V; ++k) sum[k] = 0.0f;
    for (int oh = window_start<KH, SH, PH, DH>(p.h); oh < oh_end; ++oh) {
        const int ki = offset_in<KH, SH, PH, DH>(p.h, oh);
        if (ki < 0) continue;
        for (int ow = ow_start; ow < ow_end; ++ow) {
            const int kj = offset_in<KW, SW, PW, DW>(p.w, ow);
            if (kj < 0) continue;
            const unsigned char* at = codes + oh * a.code_stride[2] + ow * a.code_stride[3];
            const auto word = *reinterpret_cast<const typename CodeWord<V>::type*>(at);
            add_pointed<V>(sum, word, ki * KW + kj,
                           grad + oh * a.grad_stride[2] + ow * a.grad_stride[3]);
        }
    }
    if (a.coef_x != nullptr) {  // a BatchNorm's batch-statistics terms, at every element
        const Values<V> x = load_values<V>(a.x + map_offset(a.x_stride, p.n, p.c * V) +
                                           p.h * a.x_stride[2] + p.w * a.x_stride[3]);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c = p.c * V + k;
            sum[k] += __ldg(a.coef_x + c) * to_float(x.e[k]) + __ldg(a.coef_0 + c);
        }
    }
    Values<V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.e[k] = from_float(sum[k]);
    reinterpret_cast<Values<V>*>(a.grad_x)[i] = out;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) FORWARD_KERNEL(const Args a)
{
    pool_forward<1>(a);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) FORWARD_VECTOR_KERNEL(const Args a)
{
    pool_forward<VEC>(a);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) BACKWARD_KERNEL(const Args a)
{
    pool_backward<1>(a);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) BACKWARD_VECTOR_KERNEL(const Args a)
{
    pool_backward<VEC>(a);
}
