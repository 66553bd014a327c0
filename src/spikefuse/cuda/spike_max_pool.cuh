// spikefuse max pooling of [N, C, H, W] maps that keeps, for backward, one byte per output value:
// the position of the window's maximum in the window (its code, i * KW + j for the element at row
// offset i and column offset j), where ATen keeps an int64 index into the map.
//
// spikefuse/cuda/spike_max_pool.py compiles this file once per storage dtype, after a prelude
// that defines:
//   scalar_t, to_float, from_float   storage type (float, __half, __nv_bfloat16) and conversions
//   BLOCK_THREADS                    threads per block
//   FORWARD_KERNEL, BACKWARD_KERNEL  the names of the two entry points (at the end of this file)
//
// FORWARD_KERNEL: one thread per output value, threads in the output's memory order (channels
// innermost for a channels-last map: a warp reads 32 channels of one position, coalesced). It
// scans the window in ATen's order (rows, then columns), taking an element where it is greater
// than the maximum so far or NaN, from -inf and the window's first element inside the map: the
// first of equal maxima wins (of binary spikes: the first spike, else the first element), padded
// positions never do, as in ATen's max_pool2d on CPU and CUDA.
//
// BACKWARD_KERNEL: one thread per input element, in the input gradient's memory order: a gather.
// The element sums the gradients of the windows that contain it and whose code points at it, in
// float, windows in ascending (row, column) order, and writes the sum once: ATen's CUDA backward
// (p_start / p_end bound the windows whose span covers the element), without its int64 reads.
// Deterministic, no atomics.

// The one argument of both kernels (packed by spike_max_pool.py's ARGS; same field order).
struct Args {
    const scalar_t* x;          // forward: the input, any strides (x_stride)
    scalar_t* out;              // forward: the output, dense in the threads' order
    unsigned char* codes;       // forward: written like out (null: not kept); backward: read
    const scalar_t* grad_out;   // backward: dL/dout, any strides (grad_stride)
    scalar_t* grad_x;           // backward: dL/dx, dense in the threads' order
    long long n;                // threads: out's elements (forward), grad_x's (backward)
    long long x_stride[4];      // N, C, H, W strides in elements
    long long code_stride[4];
    long long grad_stride[4];
    int size[4];                // N, C, H, W of the input
    int pooled[2];              // OH, OW
    int kernel[2];
    int stride[2];
    int pad[2];
    int dilation[2];
    int channels_last;          // the threads' order: N, H, W, C (1) or N, C, H, W (0)
};

struct Position {
    int n, c, h, w;
};

// The coordinates of element i of a dense [N, C, height, width] tensor in the threads' order.
__device__ __forceinline__ Position position_of(long long i, int channels, int height, int width,
                                                int channels_last)
{
    Position p;
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

__device__ __forceinline__ long long offset_of(const long long* stride, int n, int c, int h, int w)
{
    return n * stride[0] + c * stride[1] + h * stride[2] + w * stride[3];
}

// The first offset i of a window starting at `start` whose element start + i * dilation lies
// inside the map (start >= -pad > -kernel * dilation, so one does).
__device__ __forceinline__ int first_inside(int start, int dilation)
{
    return start < 0 ? (-start + dilation - 1) / dilation : 0;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) FORWARD_KERNEL(const Args a)
{
    const long long i = (long long)blockIdx.x * BLOCK_THREADS + threadIdx.x;
    if (i >= a.n) return;
    const Position p = position_of(i, a.size[1], a.pooled[0], a.pooled[1], a.channels_last);
    const int h0 = p.h * a.stride[0] - a.pad[0];
    const int w0 = p.w * a.stride[1] - a.pad[1];
    const int i0 = first_inside(h0, a.dilation[0]);
    const int j0 = first_inside(w0, a.dilation[1]);
    const scalar_t* x = a.x + offset_of(a.x_stride, p.n, p.c, 0, 0);
    const float lowest = __int_as_float(0xff800000);  // -inf
    float best = lowest;
    scalar_t value = from_float(lowest);
    int code = i0 * a.kernel[1] + j0;
    for (int ki = i0; ki < a.kernel[0]; ++ki) {
        const int h = h0 + ki * a.dilation[0];
        if (h >= a.size[2]) break;
        for (int kj = j0; kj < a.kernel[1]; ++kj) {
            const int w = w0 + kj * a.dilation[1];
            if (w >= a.size[3]) break;
            const scalar_t v = x[h * a.x_stride[2] + w * a.x_stride[3]];
            const float f = to_float(v);
            if (f > best || f != f) {  // greater, or NaN: ATen's rule
                best = f;
                value = v;
                code = ki * a.kernel[1] + kj;
            }
        }
    }
    a.out[i] = value;
    if (a.codes != nullptr) a.codes[i] = (unsigned char)code;
}

// ATen's range of windows (along one axis) whose span covers input coordinate `at`.
__device__ __forceinline__ int window_start(int at, int pad, int kernel, int dilation, int stride)
{
    const int span = (kernel - 1) * dilation + 1;
    return at + pad < span ? 0 : (at + pad - span) / stride + 1;
}

__device__ __forceinline__ int window_end(int at, int pad, int pooled, int stride)
{
    const int end = (at + pad) / stride + 1;
    return end < pooled ? end : pooled;
}

// The offset of coordinate `at` in the window starting at `start`, or -1 where the window skips it
// (dilation) or ends before it.
__device__ __forceinline__ int offset_in(int at, int start, int dilation, int kernel)
{
    const int d = at - start;
    if (d < 0 || d % dilation != 0 || d / dilation >= kernel) return -1;
    return d / dilation;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) BACKWARD_KERNEL(const Args a)
{
    const long long i = (long long)blockIdx.x * BLOCK_THREADS + threadIdx.x;
    if (i >= a.n) return;
    const Position p = position_of(i, a.size[1], a.size[2], a.size[3], a.channels_last);
    const int oh_end = window_end(p.h, a.pad[0], a.pooled[0], a.stride[0]);
    const int ow_start = window_start(p.w, a.pad[1], a.kernel[1], a.dilation[1], a.stride[1]);
    const int ow_end = window_end(p.w, a.pad[1], a.pooled[1], a.stride[1]);
    const unsigned char* codes = a.codes + offset_of(a.code_stride, p.n, p.c, 0, 0);
    const scalar_t* grad = a.grad_out + offset_of(a.grad_stride, p.n, p.c, 0, 0);
    float sum = 0.0f;
    for (int oh = window_start(p.h, a.pad[0], a.kernel[0], a.dilation[0], a.stride[0]);
         oh < oh_end; ++oh) {
        const int ki = offset_in(p.h, oh * a.stride[0] - a.pad[0], a.dilation[0], a.kernel[0]);
        if (ki < 0) continue;
        for (int ow = ow_start; ow < ow_end; ++ow) {
            const int kj = offset_in(p.w, ow * a.stride[1] - a.pad[1], a.dilation[1], a.kernel[1]);
            if (kj < 0) continue;
            if (codes[oh * a.code_stride[2] + ow * a.code_stride[3]] == ki * a.kernel[1] + kj)
                sum += to_float(grad[oh * a.grad_stride[2] + ow * a.grad_stride[3]]);
        }
    }
    a.grad_x[i] = from_float(sum);
}
