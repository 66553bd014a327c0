// Spikformer's self-attention product of one spike tensor, per head, in one kernel each way:
//
//     out = s (V Kᵀ) Q          q, k, v: the heads [D, L] of the channels 0..C, C..2C, 2C..3C of
//                               qkv [R, 3C, L] (D channels per head, L tokens, C = heads D)
//
// with V Kᵀ (a [D, D] matrix of coincidence counts) kept in shared memory, so that no count, no
// converted operand and no transposed copy goes through global memory. Backward, from dL/dout G:
//
//     P = V Kᵀ (recomputed), S = G Qᵀ:   dQ = s Pᵀ G,   dV = s S K,   dK = s Sᵀ V
//
// written straight into the slots of dL/dqkv. Every product sums in float32: the counts and
// (V Kᵀ) Q of 0/1 spikes are integers below 2^24 (the host checks D L ≤ 2^24), so forward is
// exact in any order and equals the float32 matmuls bit for bit once scaled; backward's sums of
// gradient values are float32 sums in another order than cuBLAS's.
//
// spikefuse/cuda/spike_attention.py compiles this file once per storage dtype and head size,
// after a prelude that defines:
//   scalar_t, to_float, from_float   storage type (float, __half, __nv_bfloat16) and conversions
//   BLOCK_THREADS                    threads per block (the kernels step by blockDim.x)
//   D                                channels per head
//   TILE                             tokens per shared-memory tile
//   FORWARD_KERNEL, BACKWARD_KERNEL  the names of the two entry points
//
// One block per (row, head). Its threads load each tile of TILE tokens with the channels
// innermost, so where qkv, dL/dout and the outputs lie so (a fused block's spikes, and what
// forward writes) every global load of a warp is contiguous. Each thread computes four sums at a
// time: four columns of a [D, D] matrix, or four tokens of an output channel, so that one
// 16-byte shared-memory load serves four multiply-adds (with a load per multiply-add, shared-
// memory loads bounded them: 1.6x slower on an H200). D must be a multiple of 4.

struct Args {
    const scalar_t* qkv;           // forward: the spikes [R, 3C, L] (qkv_stride)
    const unsigned char* spikes;   // backward: the same spikes saved as bytes (qkv_stride)
    const scalar_t* grad_out;      // backward: dL/dout [R, C, L] (out_stride)
    scalar_t* out;                 // forward: out [R, C, L] (out_stride)
    scalar_t* grad_qkv;            // backward: dL/dqkv [R, 3C, L] (grad_stride)
    long long qkv_stride[3];       // row, channel, token strides in elements
    long long out_stride[3];
    long long grad_stride[3];
    int heads;
    int tokens;                    // L
    float scale;                   // s
};

// Four floats of one shared-memory row, read as one 16-byte load (rows of D and of TILE + 4
// floats are multiples of 16 bytes; D is a multiple of 4).
struct alignas(16) Quad {
    float e[4];
};

__device__ __forceinline__ Quad quad(const float* p) { return *reinterpret_cast<const Quad*>(p); }

// One value of the inputs, read through the read-only cache: nothing the kernels write aliases
// them, so the compiler may issue these loads ahead of shared-memory stores.
__device__ __forceinline__ float spike(const scalar_t* p) { return to_float(__ldg(p)); }
__device__ __forceinline__ float spike(const unsigned char* p) { return __ldg(p) ? 1.0f : 0.0f; }

constexpr int TILE_ROW = TILE + 4;  // a channel's row of a tile: 16-byte aligned, banks staggered

constexpr int STAGE = 4;  // loads of a tile a thread has in flight before it stores them

// Channels [first, first + D) of tokens [l0, l0 + TILE) of one row of a [.., L] tensor with
// `stride` (channel, token), zeros past the last token (sums over whole tiles add nothing for
// them), into tile[t * D + c] (a row per token: `by_channel` false) or tile[c * TILE_ROW + t]
// (a row per channel). Each thread issues STAGE read-only loads, then stores them: the loads'
// latencies overlap.
template <typename T>
__device__ __forceinline__ void load_tile(float* tile, bool by_channel, const T* row,
                                          const long long* stride, int first, int l0, int tokens)
{
    for (int base = threadIdx.x; base < TILE * D; base += STAGE * blockDim.x) {
        float x[STAGE];
#pragma unroll
        for (int u = 0; u < STAGE; ++u) {
            const int e = base + u * blockDim.x, t = e / D, c = e % D;
            x[u] = e < TILE * D && l0 + t < tokens
                       ? spike(row + (first + c) * stride[1] + (long long)(l0 + t) * stride[2])
                       : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < STAGE; ++u) {
            const int e = base + u * blockDim.x, t = e / D, c = e % D;
            if (e < TILE * D) tile[by_channel ? c * TILE_ROW + t : t * D + c] = x[u];
        }
    }
}

// sum[i][j] += Σ_t a[t][i] b[t][j] over one tile of [TILE][D] tiles; a thread sums four
// neighbouring j of one i: a is read per thread, b's four as one load all threads of a warp
// share (a warp's i are neighbours, its j the same).
__device__ __forceinline__ void accumulate(float (*sum)[D + 1], const float* a, const float* b)
{
    for (int e = threadIdx.x; e < D * D / 4; e += blockDim.x) {
        const int i = e % D, j = 4 * (e / D);
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int t = 0; t < TILE; ++t) {
            const float x = a[t * D + i];
            const Quad y = quad(b + t * D + j);
#pragma unroll
            for (int k = 0; k < 4; ++k) s[k] = __fmaf_rn(x, y.e[k], s[k]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) sum[i][j + k] += s[k];
    }
}

__device__ __forceinline__ void clear(float (*sum)[D + 1])
{
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) sum[e / D][e % D] = 0.0f;
}

// sum[i][j] = Σ_l a[i, l] b[j, l] over all tokens: a and b are channels [a_first, +D) and
// [b_first, +D) of rows a_row and b_row (with their strides).
template <typename A, typename B>
__device__ void token_sums(float (*sum)[D + 1], float* a, float* b, const A* a_row,
                           const long long* a_stride, int a_first, const B* b_row,
                           const long long* b_stride, int b_first, int tokens)
{
    clear(sum);
    for (int l0 = 0; l0 < tokens; l0 += TILE) {
        __syncthreads();  // the previous tile's readers are done
        load_tile(a, false, a_row, a_stride, a_first, l0, tokens);
        load_tile(b, false, b_row, b_stride, b_first, l0, tokens);
        __syncthreads();
        accumulate(sum, a, b);
    }
    __syncthreads();
}

// Shared tiles big enough for [TILE][D] and for [D][TILE_ROW].
constexpr int TILE_FLOATS = D * TILE_ROW;

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) FORWARD_KERNEL(const Args a)
{
    __shared__ float counts[D][D + 1];  // P = V Kᵀ
    __shared__ __align__(16) float first[TILE_FLOATS];
    __shared__ __align__(16) float second[TILE_FLOATS];
    const int row = blockIdx.x / a.heads, head = blockIdx.x % a.heads;
    const int C = a.heads * D, q = head * D, k = C + q, v = 2 * C + q;
    const scalar_t* in = a.qkv + row * a.qkv_stride[0];
    scalar_t* out = a.out + row * a.out_stride[0];
    token_sums(counts, first, second, in, a.qkv_stride, v, in, a.qkv_stride, k, a.tokens);
    for (int l0 = 0; l0 < a.tokens; l0 += TILE) {
        load_tile(first, true, in, a.qkv_stride, q, l0, a.tokens);  // Q by channel
        __syncthreads();
        // out[i, l0 + t..t+3] = s Σ_j P[i][j] Q[j, l0 + t..t+3]: a thread per i and 4 tokens
        for (int e = threadIdx.x; e < D * TILE / 4; e += blockDim.x) {
            const int i = e % D, t = 4 * (e / D);
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
            for (int j = 0; j < D; ++j) {
                const float p = counts[i][j];
                const Quad x = quad(first + j * TILE_ROW + t);
#pragma unroll
                for (int n = 0; n < 4; ++n) s[n] = __fmaf_rn(p, x.e[n], s[n]);
            }
#pragma unroll
            for (int n = 0; n < 4; ++n)
                if (l0 + t + n < a.tokens)
                    out[(q + i) * a.out_stride[1] + (long long)(l0 + t + n) * a.out_stride[2]] =
                        from_float(s[n] * a.scale);
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) BACKWARD_KERNEL(const Args a)
{
    __shared__ float counts[D][D + 1];       // P = V Kᵀ
    __shared__ float grad_counts[D][D + 1];  // S = G Qᵀ (dP = s S)
    __shared__ __align__(16) float first[TILE_FLOATS];
    __shared__ __align__(16) float second[TILE_FLOATS];
    __shared__ __align__(16) float third[TILE_FLOATS];
    const int row = blockIdx.x / a.heads, head = blockIdx.x % a.heads;
    const int C = a.heads * D, q = head * D, k = C + q, v = 2 * C + q;
    const unsigned char* in = a.spikes + row * a.qkv_stride[0];
    const scalar_t* grad = a.grad_out + row * a.out_stride[0];
    scalar_t* grad_in = a.grad_qkv + row * a.grad_stride[0];
    token_sums(counts, first, second, in, a.qkv_stride, v, in, a.qkv_stride, k, a.tokens);
    token_sums(grad_counts, first, second, grad, a.out_stride, q, in, a.qkv_stride, q, a.tokens);
    for (int l0 = 0; l0 < a.tokens; l0 += TILE) {
        load_tile(first, true, grad, a.out_stride, q, l0, a.tokens);  // G, K, V by channel
        load_tile(second, true, in, a.qkv_stride, k, l0, a.tokens);
        load_tile(third, true, in, a.qkv_stride, v, l0, a.tokens);
        __syncthreads();
        // a thread per channel c and 4 tokens: (Pᵀ G)[c], (S K)[c], (Sᵀ V)[c]
        for (int e = threadIdx.x; e < D * TILE / 4; e += blockDim.x) {
            const int c = e % D, t = 4 * (e / D);
            float dq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float dk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
            for (int j = 0; j < D; ++j) {
                const float p = counts[j][c], s_row = grad_counts[c][j], s_col = grad_counts[j][c];
                const Quad g = quad(first + j * TILE_ROW + t);
                const Quad kj = quad(second + j * TILE_ROW + t);
                const Quad vj = quad(third + j * TILE_ROW + t);
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    dq[n] = __fmaf_rn(p, g.e[n], dq[n]);
                    dv[n] = __fmaf_rn(s_row, kj.e[n], dv[n]);
                    dk[n] = __fmaf_rn(s_col, vj.e[n], dk[n]);
                }
            }
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                if (l0 + t + n >= a.tokens) break;
                const long long at = (long long)(l0 + t + n) * a.grad_stride[2];
                grad_in[(q + c) * a.grad_stride[1] + at] = from_float(dq[n] * a.scale);
                grad_in[(k + c) * a.grad_stride[1] + at] = from_float(dk[n] * a.scale);
                grad_in[(v + c) * a.grad_stride[1] + at] = from_float(dv[n] * a.scale);
            }
        }
        __syncthreads();
    }
}
