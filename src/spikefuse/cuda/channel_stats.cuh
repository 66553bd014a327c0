// spikefuse per-channel BatchNorm statistics: the mean and invstd = 1 / sqrt(biased variance + eps)
// of every channel of a [rows, C] matrix stored row-major (channels innermost, row stride C): the
// memory of a channels-last convolution output [N, C, H, W] or of a Linear output [T, B, C].
//
// spikefuse/cuda/channel_stats.py compiles this file once per (storage dtype, VEC), after a
// prelude that defines:
//   scalar_t, to_float             storage type (float, __half, __nv_bfloat16), conversion to float
//   VEC                            consecutive channels per thread: one vector load per row
//   PARTIAL_KERNEL, MERGE_KERNEL   the names of the two entry points (at the end of this file)
//
// Two launches, both reading consecutive channels with consecutive threads (coalesced):
//   1. PARTIAL_KERNEL, grid (channel tiles, row chunks), block (TX channel vectors, TY rows):
//      each thread streams every TY-th row of its block's chunk for its VEC channels, the block
//      merges its TY rows of threads, and writes the chunk's (mean, M2) per channel. Chunks
//      enough for one full wave of MIN_BLOCKS blocks per SM; UNROLL loads in flight per thread.
//   2. MERGE_KERNEL, grid (channel tiles of MERGE_CHANNELS), block (MERGE_CHANNELS, MERGE_LANES):
//      each lane merges every MERGE_LANES-th chunk in order, the block merges its lanes, and
//      writes mean[c] and invstd[c] (and in training updates BatchNorm's running statistics).
//
// Numerics (float32 throughout, robust where a naive sum of squares is not):
//   - Every value is shifted by its channel's pivot, the channel's value in row 0 (a sample of
//     the data, so near the mean in units of the standard deviation): means stay small numbers
//     even for a channel with a large mean and a small variance, whose deviations a float32
//     mean of magnitude ~mean would round away.
//   - Each thread runs Welford's update on the shifted values (no sum of squares to cancel).
//   - Partial results are combined with Chan et al.'s pairwise formula, in a fixed order, so
//     the statistics are the same bits on every run (no atomics).
//   - NaN or Inf anywhere in a channel makes its mean or M2 NaN/Inf (Inf - Inf and 0 * Inf
//     are NaN), so its invstd is never a finite number computed from non-finite input.
// Counts are not stored: every chunk's and thread's count follows from the launch geometry.
// As torch.batch_norm_stats: invstd = rsqrt(var + eps), and 0 where var = eps = 0.

constexpr int MAX_THREADS = 256;  // threads per block of PARTIAL_KERNEL (TX * TY <= this)
// Blocks of PARTIAL_KERNEL resident per SM that the register budget must allow (85 registers
// per thread; bfloat16 with VEC = 8 uses 78, spilling at 64): the launch fills exactly this many
// per SM, one wave of equally long blocks. Without it ptxas may cap VEC = 1 at 32 registers and
// spill.
constexpr int MIN_BLOCKS = 3;
constexpr int UNROLL = 4;  // rows loaded before any is used: loads in flight per thread
constexpr int MERGE_CHANNELS = 32;
constexpr int MERGE_LANES = 32;  // chunks merged side by side per channel in MERGE_KERNEL

// The one argument of both kernels (packed by channel_stats.py's ARGS; same field order).
struct Args {
    const scalar_t* y;    // [rows, channels], row stride = channels
    float* partial;       // [2, chunks, channels]: per chunk, mean of y - pivot, then M2
    float* mean;          // [channels]
    float* invstd;        // [channels]
    // BatchNorm's running statistics, updated in training as torch's BatchNorm does (null: no
    // update): running = (1 - m) running + m batch, with the unbiased variance; and its batch
    // counter, which PARTIAL_KERNEL increments (so MERGE_KERNEL, launched after it, reads the new
    // count for the cumulative average m = 1 / count).
    float* running_mean;  // [channels]
    float* running_var;   // [channels]
    long long* batches_tracked;  // one counter
    long long rows;
    long long rows_per_chunk;  // a multiple of TY; the last chunk may be shorter
    int channels;
    int chunks;
    float eps;
    float momentum;  // m, unless cumulative
    int cumulative;  // m = 1 / *batches_tracked (torch's momentum=None)
};

// VEC neighbouring channels of one row: one vector load.
struct alignas(sizeof(scalar_t) * VEC) pack_t {
    scalar_t e[VEC];
};

__device__ __forceinline__ pack_t load_pack(const scalar_t* p, const long long i)
{
    return *reinterpret_cast<const pack_t*>(p + i);
}

// Chan et al.'s merge of side b (count n_b, mean_b, m2_b) into side a (count n, mean, m2): means
// and sums of squared deviations from the mean; the caller adds the counts. Empty sides are
// skipped: counts depend only on the launch geometry, never on the data, so these branches do not
// diverge on values, and an empty side's zeros cannot turn an Inf mean into NaN via delta * 0.
__device__ __forceinline__ void chan_merge(
    const float n, float& mean, float& m2, const float n_b, const float mean_b, const float m2_b)
{
    if (n_b == 0.0f)
        return;
    if (n == 0.0f) {
        mean = mean_b, m2 = m2_b;
        return;
    }
    const float delta = mean_b - mean;
    const float w_b = n_b * __frcp_rn(n + n_b);  // exact counts: one rounding more is harmless
    mean = __fmaf_rn(delta, w_b, mean);
    m2 = m2 + m2_b + delta * delta * (n * w_b);  // + delta^2 n n_b / (n + n_b)
}

// Welford's update of VEC channels with one row's shifted values. The count is shared by the
// VEC channels: one reciprocal per row.
__device__ __forceinline__ void welford_row(
    float& n, float (&mean)[VEC], float (&m2)[VEC], const float (&pivot)[VEC], const pack_t& row)
{
    n += 1.0f;
    const float inv_n = __frcp_rn(n);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const float d = to_float(row.e[k]) - pivot[k];
        const float delta = d - mean[k];
        mean[k] = __fmaf_rn(delta, inv_n, mean[k]);
        m2[k] = __fmaf_rn(delta, d - mean[k], m2[k]);
    }
}

// A block's scratch for fold_slots: W statistics per thread, CAPACITY threads at most. Entry
// (slot, column) lives at slot * columns + column: consecutive threads of a warp hold consecutive
// columns, so they touch consecutive words (no bank conflicts).
template <int W, int CAPACITY>
struct Scratch {
    float n[CAPACITY];
    float mean[W][CAPACITY];
    float m2[W][CAPACITY];
};

// Merges a block's `slots` rows of threads into row 0: the thread at (slot, column) holds count
// n and W (mean, m2) pairs in registers. Pairwise, slot i taking in slot i + stride with strides
// halving from the largest power of two below `slots`: a fixed order (deterministic results) in
// log2(slots) levels. Every thread of the block must call it (it synchronises the block).
template <int W, int CAPACITY>
__device__ __forceinline__ void fold_slots(
    float& n, float (&mean)[W], float (&m2)[W], const int slot, const int slots, const int column,
    const int columns, Scratch<W, CAPACITY>& s)
{
    int stride = 1;
    while (2 * stride < slots)
        stride *= 2;
    for (; stride > 0; stride /= 2) {
        if (slot >= stride && slot < 2 * stride) {  // the slots read at this level
            const int i = slot * columns + column;
            s.n[i] = n;
#pragma unroll
            for (int k = 0; k < W; ++k)
                s.mean[k][i] = mean[k], s.m2[k][i] = m2[k];
        }
        __syncthreads();
        if (slot < stride && slot + stride < slots) {
            const int j = (slot + stride) * columns + column;
            const float n_b = s.n[j];
#pragma unroll
            for (int k = 0; k < W; ++k)
                chan_merge(n, mean[k], m2[k], n_b, s.mean[k][j], s.m2[k][j]);
            n += n_b;
        }
        __syncthreads();  // the next level overwrites slots read at this one
    }
}

// ---- launch 1: per-chunk partial statistics -----------------------------------------------------
extern "C" __global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS) PARTIAL_KERNEL(const Args a)
{
    const int tx = threadIdx.x, ty = threadIdx.y, rows_step = blockDim.y;
    const long long c0 = ((long long)blockIdx.x * blockDim.x + tx) * VEC;  // first channel
    const bool active = c0 < a.channels;  // the last channel tile may be partly idle
    const long long begin = (long long)blockIdx.y * a.rows_per_chunk;
    const long long end = min(begin + a.rows_per_chunk, a.rows);
    if (a.batches_tracked != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && tx == 0 && ty == 0)
        *a.batches_tracked += 1;  // one thread of the launch counts the batch

    // Statistics of the shifted values y - pivot of this thread's rows: begin + ty + i * TY.
    float n = 0.0f, mean[VEC], m2[VEC], pivot[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        mean[k] = 0.0f, m2[k] = 0.0f;
    if (active) {
        // Every thread of a channel reads the same pivot, row 0's value (cached after the first).
        const pack_t first = load_pack(a.y, c0);
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            pivot[k] = to_float(first.e[k]);
        long long r = begin + ty;
        for (; r + (UNROLL - 1) * rows_step < end; r += UNROLL * rows_step) {
            pack_t rows[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)  // all loads first: UNROLL of them in flight
                rows[u] = load_pack(a.y, (r + u * rows_step) * a.channels + c0);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                welford_row(n, mean, m2, pivot, rows[u]);
        }
        for (; r < end; r += rows_step)
            welford_row(n, mean, m2, pivot, load_pack(a.y, r * a.channels + c0));
    }

    __shared__ Scratch<VEC, MAX_THREADS> scratch;
    fold_slots(n, mean, m2, ty, rows_step, tx, blockDim.x, scratch);
    if (ty == 0 && active) {
        float* const chunk_mean = a.partial + (long long)blockIdx.y * a.channels;
        float* const chunk_m2 = chunk_mean + (long long)a.chunks * a.channels;
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            chunk_mean[c0 + k] = mean[k], chunk_m2[c0 + k] = m2[k];
    }
}

// ---- launch 2: merge the chunks, write mean and invstd ------------------------------------------
extern "C" __global__ void __launch_bounds__(MERGE_CHANNELS * MERGE_LANES) MERGE_KERNEL(const Args a)
{
    const int lane = threadIdx.y;
    const long long c = (long long)blockIdx.x * MERGE_CHANNELS + threadIdx.x;
    const bool active = c < a.channels;

    float n = 0.0f, mean[1] = {0.0f}, m2[1] = {0.0f};
    if (active) {
        for (int k = lane; k < a.chunks; k += MERGE_LANES) {
            const long long first_row = k * a.rows_per_chunk;
            const float n_k = (float)min(a.rows_per_chunk, a.rows - first_row);
            const float* const chunk_mean = a.partial + (long long)k * a.channels;
            const float* const chunk_m2 = chunk_mean + (long long)a.chunks * a.channels;
            chan_merge(n, mean[0], m2[0], n_k, chunk_mean[c], chunk_m2[c]);
            n += n_k;
        }
    }

    __shared__ Scratch<1, MERGE_CHANNELS * MERGE_LANES> scratch;
    fold_slots(n, mean, m2, lane, MERGE_LANES, threadIdx.x, MERGE_CHANNELS, scratch);
    if (lane == 0 && active) {
        float var = m2[0] / (float)a.rows;  // biased, as BatchNorm normalises with
        var = var < 0.0f ? 0.0f : var;  // rounding may leave a tiny negative M2; NaN stays NaN
        const float batch_mean = to_float(a.y[c]) + mean[0];  // undo the shift by the pivot
        a.mean[c] = batch_mean;
        a.invstd[c] = var == 0.0f && a.eps == 0.0f ? 0.0f : rsqrtf(var + a.eps);
        if (a.running_mean != nullptr) {  // the formula of torch's batch_norm_gather_stats
            const float m = a.cumulative ? 1.0f / (float)*a.batches_tracked : a.momentum;
            const float unbiased = var * ((float)a.rows / (float)(a.rows - 1));  // rows > 1
            a.running_mean[c] = (1.0f - m) * a.running_mean[c] + m * batch_mean;
            a.running_var[c] = (1.0f - m) * a.running_var[c] + m * unbiased;
        }
    }
}
