// spikefuse neuron kernels: the loop structure shared by every neuron, dtype and reset rule.
//
// spikefuse/cuda/codegen.py compiles this file once per variant, after a generated prelude that
// defines what varies:
//   scalar_t, to_float, from_float    storage type (float, __half, __nv_bfloat16) and conversions
//   index_t                           element indices: int, or long long past 32 bits
//   VEC, BLOCK_THREADS, MIN_BLOCKS,   neurons per thread, launch bounds (backward, forward),
//   FPTT_MIN_BLOCKS,                  backward's chunk length,
//   CHUNK, LOAD_STEPS                 forward's loads in flight
//   ADAPTIVE, AFFINE, N_LEARNABLE     two-state neuron; BatchNorm folded in; learnable parameters
//   POOL                              pooled kernels: the k of the k x k windows averaged (1: none)
//   RESIDUAL                          affine kernels adding R to X (a residual block's shortcut)
//   KEEPS_INPUT_GRAD                  affine kernels whose pass 1 may also write dL/dX
//   Args                              the kernels' one argument (fields as in codegen.py)
//   Params, load_params(a)            the neuron's parameters, read once per thread
//   charge, reset, surrogate_grad,    the neuron's device functions, printed from its sympy
//   dv_dh, dh_dx, dh_dv, ...          equations (see codegen.py for the full list)
//   FPTT_KERNEL, BPTT_KERNEL          the names of the two entry points (at the end of this file)
//
// The kernel bodies are templates (on Args) so that `if constexpr` drops a variant's unused
// parts (the adaptive and affine ones) without the names they use having to exist.
//
// Numerics: forward arithmetic is correctly rounded (compiled without FMA contraction, exact
// division in the printed equations), so H, V and the spikes equal PyTorch's float32 bit for bit;
// backward recomputes H with the same `step` function, so it sees exactly the forward's values.

// VEC neighbouring elements of one step: one vector load or store.
struct alignas(sizeof(scalar_t) * VEC) pack_t {
    scalar_t e[VEC];
};

__device__ __forceinline__ pack_t load_pack(const scalar_t* p, const index_t i)
{
    return *reinterpret_cast<const pack_t*>(p + i);
}

__device__ __forceinline__ void store_pack(scalar_t* p, const index_t i, const pack_t& v)
{
    *reinterpret_cast<pack_t*>(p + i) = v;
}

// C++ has no empty arrays: the learnable gradients take one unused slot without parameters.
constexpr int LEARNABLE_SLOTS = N_LEARNABLE > 0 ? N_LEARNABLE : 1;

// Pooled kernels (POOL > 1; affine, channels-last maps [B, H, W, C] per step, H and W multiples
// of POOL): a thread owns one element i of the pooled map [B, H/POOL, W/POOL, C] and the WINDOW
// neurons of its window, which share i's channel i % C. Consecutive threads take consecutive
// channels, so every load and store stays coalesced.
constexpr int WINDOW = POOL * POOL;  // neurons per output element (1: unpooled)

// Offset of the window's neuron k (row k / POOL, column k % POOL) from its first neuron.
template <class Args>
__device__ __forceinline__ index_t window_offset(const Args& a, const int k)
{
    return ((k / POOL) * a.pool_width * POOL + k % POOL) * a.channels;
}

// The window's first neuron: element i = (row * W/POOL + col) * C + c (row = b H/POOL + h/POOL)
// averages the neurons from (POOL row * W + POOL col) * C + c on.
template <class Args>
__device__ __forceinline__ index_t window_first_neuron(const Args& a, const index_t i)
{
    const index_t pixel = i / a.channels, row = pixel / a.pool_width;
    return ((row * a.pool_width * POOL + pixel % a.pool_width) * POOL) * a.channels
         + i % a.channels;
}

// The neuron a backward walk of a thread's slot takes: the slot itself (unpooled kernels), or
// the window's neuron `walk` (pooled kernels walk their window's neurons one after another).
template <class Args>
__device__ __forceinline__ index_t walked_neuron(const Args& a, const index_t slot,
                                                const int walk)
{
    if constexpr (POOL > 1)
        return window_first_neuron(a, slot) + window_offset(a, walk);
    else
        return slot;
}

// Elements from one step of x_seq to the next: N, or in the unpooled affine kernels x_step,
// which is 0 for a Y repeated over time (an input image's synapse output at every step). The
// other [T, N] sequences never repeat; pooled kernels have no x_step (blocks fold no pooling
// for such a Y).
template <class Args>
__device__ __forceinline__ index_t x_step_of(const Args& a)
{
    if constexpr (AFFINE && POOL == 1)
        return a.x_step;
    else
        return a.N;
}

// One step of one neuron, shared by forward and backward's recompute (same float32 results):
// returns H[t]; updates v = V[t-1] -> V[t] and w = W[t-1] -> W[t].
template <class P>
__device__ __forceinline__ float step(float& v, float& w, const float x, const P& p)
{
    const float h = charge(v, x, w, p);
    if constexpr (ADAPTIVE)
        w = adaptation(v, x, w, h, p) + (h >= p.v_threshold ? adaptation_jump(p) : 0.0f);
    v = reset(h, p);
    return h;
}

// V[-1] and W[-1] of neuron i: the given state, or the constant start where it is null (always
// in the affine kernels; one-state neurons have no W).
template <class Args>
__device__ __forceinline__ float initial_v(const Args& a, const index_t i)
{
    if constexpr (AFFINE)
        return a.v_init;
    else
        return a.v0 ? a.v0[i] : a.v_init;
}

template <class Args>
__device__ __forceinline__ float initial_w(const Args& a, const index_t i)
{
    if constexpr (ADAPTIVE)
        return a.w0 ? a.w0[i] : a.w_init;
    else
        return 0.0f;
}

// Affine kernels: BatchNorm of channel c as X = Y * scale + shift, scale = invstd * gamma,
// shift = beta - mean * scale; the same float32 operations, in the same order, as the torch
// composite's (spikefuse.fused).
template <class Args>
__device__ __forceinline__ void channel_affine(const Args& a, const index_t c, float& scale,
                                               float& shift)
{
    const float mean = a.bn_mean[c], invstd = a.bn_invstd[c];
    scale = a.bn_weight ? invstd * a.bn_weight[c] : invstd;
    shift = a.bn_bias ? -mean * scale + a.bn_bias[c] : -mean * scale;
}

// The neuron's input X from a loaded element y: y itself, or Y * scale + shift (affine kernels),
// plus r (the loaded element of R) in the residual kernels.
__device__ __forceinline__ float neuron_input(const float y, const float (&scale)[VEC],
                                              const float (&shift)[VEC], const int k,
                                              const float r = 0.0f)
{
    if constexpr (RESIDUAL)
        return __fadd_rn(__fmaf_rn(y, scale[k], shift[k]), r);
    return AFFINE ? __fmaf_rn(y, scale[k], shift[k]) : y;
}

// Element k of a pack of R, loaded where the kernels add a residual (0 elsewhere: unread).
__device__ __forceinline__ float residual_at(const pack_t& rp, const int k)
{
    if constexpr (RESIDUAL)
        return to_float(rp.e[k]);
    return 0.0f;
}

// S[t] from H[t]; a NaN H gives a NaN spike, never a valid "no spike" (the NaN policy).
template <class P>
__device__ __forceinline__ float spike_of(const float h, const P& p)
{
    return h >= p.v_threshold ? 1.0f : (isnan(h) ? h : 0.0f);
}

// The pooled kernels' forward may also write each mean as the WINDOW spikes behind it, one bit
// each, as spikefuse/cuda/spike_bits.cuh lays packings out: a fused block keeps those bits to
// restore its output in backward (the next layer's saved input) instead of recomputing it from
// Y, which reads WINDOW elements of Y per mean. LANES neighbouring lanes fill a 32-bit word,
// which their first lane writes with the word's NaN flag. The launcher passes spike_words only
// where every warp is whole (means per step a multiple of 32), so all lanes take the shuffles.

// The thread's bits (bit k: its window's neuron k's spike) of mean `element` of [T, N / WINDOW].
template <class Args>
__device__ __forceinline__ void store_spike_bits(const Args& a, const index_t element,
                                                 unsigned int bits, const bool nan)
{
    if constexpr (POOL > 1 && 32 % WINDOW == 0) {
        constexpr int LANES = 32 / WINDOW;
        const int lane = threadIdx.x % 32, first_lane = lane - lane % LANES;
        bits <<= (lane - first_lane) * WINDOW;
#pragma unroll
        for (int offset = 1; offset < LANES; offset <<= 1)
            bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
        const unsigned int group = LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1u) << first_lane;
        const bool nan_in_word = (__ballot_sync(0xffffffffu, nan) & group) != 0u;
        if (lane == first_lane) {
            const index_t word = element * WINDOW / 32;
            a.spike_words[word] = bits;
            a.spike_nan[word] = nan_in_word;
        }
    }
}

// Forward through time: S[t], V[t] (if v_seq), V (and W) at chunk ends, last V (and W).
template <class Args>
__device__ __forceinline__ void neuron_fptt(const Args& a)
{
    const int T = (int)a.T;
    const index_t N = a.N, n = ((index_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const index_t x_step = x_step_of(a);
    if (n >= N)
        return;
    const auto p = load_params(a);
    // Affine kernels: this thread's neurons' channels (loaded once, used for all T).
    float scale[VEC], shift[VEC];
    if constexpr (AFFINE) {
        // Channels innermost in whole packs (the usual channels-last map): the pack's channels
        // follow the first one's, found with one division instead of VEC (each a subroutine).
        const index_t c = n / a.inner % a.channels;
        const bool consecutive = a.inner == 1 && a.channels % VEC == 0;
        for (int k = 0; k < VEC; ++k)
            channel_affine(a, consecutive ? c + k : (n + k) / a.inner % a.channels, scale[k],
                           shift[k]);
    }
    float v[VEC], w[VEC];
    for (int k = 0; k < VEC; ++k) {
        v[k] = initial_v(a, n + k);
        w[k] = initial_w(a, n + k);
    }
    for (int t0 = 0; t0 < T; t0 += CHUNK) {
        const int end = min(t0 + CHUNK, T);  // CHUNK need not be a multiple of LOAD_STEPS
        for (int g = t0; g < end; g += LOAD_STEPS) {
            const index_t base = g * N + n;  // element (g, n); step j is base + j*N
            const index_t x_base = g * x_step + n;  // of x_seq (x_step: N, or 0 repeated)
            pack_t xp[LOAD_STEPS], rp[LOAD_STEPS];  // loads first: independent, they overlap
#pragma unroll
            for (int j = 0; j < LOAD_STEPS; ++j)
                if (g + j < end) {
                    xp[j] = load_pack(a.x_seq, x_base + j * x_step);
                    if constexpr (RESIDUAL)
                        rp[j] = load_pack(a.residual_seq, base + j * N);
                }
#pragma unroll
            for (int j = 0; j < LOAD_STEPS; ++j) {
                if (g + j >= end)
                    break;
                pack_t sp, vp;
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    const float r = residual_at(rp[j], k);
                    const float x = neuron_input(to_float(xp[j].e[k]), scale, shift, k, r);
                    const float h = step(v[k], w[k], x, p);
                    sp.e[k] = from_float(spike_of(h, p));
                    vp.e[k] = from_float(v[k]);
                }
                store_pack(a.spike_seq, base + j * N, sp);
                if constexpr (!AFFINE)
                    if (a.v_seq)
                        store_pack(a.v_seq, base + j * N, vp);
            }
        }
        if (a.v_ckpt && t0 + CHUNK < T) {  // the state the next chunk starts from
            const index_t c = (t0 / CHUNK) * N + n;
            for (int k = 0; k < VEC; ++k) {
                a.v_ckpt[c + k] = v[k];
                if constexpr (ADAPTIVE)
                    if (a.w_ckpt)
                        a.w_ckpt[c + k] = w[k];
            }
        }
    }
    if constexpr (!AFFINE)
        for (int k = 0; k < VEC; ++k) {
            if (a.v_last)
                a.v_last[n + k] = v[k];
            if constexpr (ADAPTIVE)
                if (a.w_last)
                    a.w_last[n + k] = w[k];
        }
}

// Rows of a channel-tiled block (below).
constexpr int TILE_ROWS = BLOCK_THREADS / 32;

// The slot of a backward thread: the first of its VEC neurons, or (pooled kernels) its output
// element. Consecutive threads own consecutive slots, except in the unpooled affine kernels
// with channels innermost (a.channel_tiles > 0, VEC = 1): there block (x, y) of a 2-D grid
// owns the 32 channels of tile x in the row groups y, y + gridDim.y, ... of TILE_ROWS rows
// each (row r, channel c: neuron r * channels + c; neighbouring blocks read neighbouring
// channels), a thread one neuron per row group (bptt_next_slot). Pass 1 then adds up its
// rows' per-channel sums itself (block_channel_sums) and writes TILE_ROWS times the groups
// per block fewer of them, and no thread divides to find its channel (a 64-bit division is a
// subroutine of dozens of instructions). A thread's channel vectors, BatchNorm coefficients
// and block sums are set up once for all its neurons: at small T that set-up is a sizeable
// share of a backward bound by instruction issue. Threads past the last row own no neuron
// (slot N).
template <class Args>
__device__ __forceinline__ bool channel_tiled(const Args& a)
{
    if constexpr (AFFINE && VEC == 1 && POOL == 1)
        return a.channel_tiles != 0;
    return false;
}

template <class Args>
__device__ __forceinline__ index_t bptt_first_neuron(const Args& a)
{
    if constexpr (AFFINE)
        if (channel_tiled(a)) {
            const index_t row = (index_t)blockIdx.y * TILE_ROWS + threadIdx.x / 32;
            return row * a.channels < a.N ? row * a.channels + blockIdx.x * 32 + threadIdx.x % 32
                                          : a.N;
        }
    return ((index_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
}

// The slot a backward thread walks after ``slot``: in a channel-tiled block, the same channel
// in the block's next row group (gridDim.y groups on); otherwise none (N: one slot a thread).
template <class Args>
__device__ __forceinline__ index_t bptt_next_slot(const Args& a, const index_t slot)
{
    if constexpr (AFFINE)
        if (channel_tiled(a))
            return slot + (index_t)gridDim.y * TILE_ROWS * a.channels;
    return a.N;
}

// Pass 1 of a channel-tiled block: its TILE_ROWS rows' sums of each of its 32 channels, added
// in a fixed order (same bits on every run), written at [block's row group * channels + c].
template <class Args>
__device__ __forceinline__ void block_channel_sums(const Args& a, const bool owns, const float g,
                                                   const float gy)
{
    __shared__ float rows_g[TILE_ROWS][32], rows_gy[TILE_ROWS][32];
    const int lane = threadIdx.x % 32, row = threadIdx.x / 32;
    rows_g[row][lane] = owns ? g : 0.0f;
    rows_gy[row][lane] = owns ? gy : 0.0f;
    __syncthreads();
    if (row == 0) {
        float sum_g = 0.0f, sum_gy = 0.0f;
        for (int r = 0; r < TILE_ROWS; ++r) {
            sum_g += rows_g[r][lane];
            sum_gy += rows_gy[r][lane];
        }
        const index_t out = (index_t)blockIdx.y * a.channels + blockIdx.x * 32 + lane;
        a.grad_sum[out] = sum_g;
        a.grad_dot[out] = sum_gy;
    }
}

// Forward of the pooled kernels: thread i advances its window's neurons together and writes
// only their mean, element i of each step's pooled map [T, N / WINDOW]; checkpoints as
// neuron_fptt's, at the neurons' own indices. The mean is the spikes' sum (exact: at most
// WINDOW ones, or NaN) times 1 / WINDOW, as torch.mean computes it (exact for POOL = 2).
template <class Args>
__device__ __forceinline__ void neuron_fptt_pooled(const Args& a)
{
    const int T = (int)a.T;
    const index_t N = a.N, outputs = N / WINDOW;
    const index_t i = (index_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= outputs)
        return;
    const auto p = load_params(a);
    float scale, shift;  // the window's one channel
    channel_affine(a, i % a.channels, scale, shift);
    const index_t first = window_first_neuron(a, i);
    float v[WINDOW], w[WINDOW];
    for (int k = 0; k < WINDOW; ++k) {
        v[k] = initial_v(a, first + window_offset(a, k));
        w[k] = 0.0f;  // one-state neurons (affine kernels): unused
    }
    for (int t0 = 0; t0 < T; t0 += CHUNK) {
        const int end = min(t0 + CHUNK, T);  // CHUNK need not be a multiple of LOAD_STEPS
        for (int g = t0; g < end; g += LOAD_STEPS) {
            // the group's loads first: independent, so they overlap
            scalar_t yp[LOAD_STEPS][WINDOW];
#pragma unroll
            for (int j = 0; j < LOAD_STEPS; ++j)
                if (g + j < end)
#pragma unroll
                    for (int k = 0; k < WINDOW; ++k)
                        yp[j][k] = a.x_seq[(g + j) * N + first + window_offset(a, k)];
#pragma unroll
            for (int j = 0; j < LOAD_STEPS; ++j) {
                if (g + j >= end)
                    break;
                float total = 0.0f;  // of the window's spikes
                unsigned int bits = 0u;
#pragma unroll
                for (int k = 0; k < WINDOW; ++k) {
                    const float x = __fmaf_rn(to_float(yp[j][k]), scale, shift);  // neuron_input
                    const float spike = spike_of(step(v[k], w[k], x, p), p);
                    total += spike;
                    bits |= (unsigned int)(spike != 0.0f) << k;
                }
                a.spike_seq[(g + j) * outputs + i] = from_float(total * (1.0f / WINDOW));
                if (a.spike_words)
                    store_spike_bits(a, (g + j) * outputs + i, bits, isnan(total));
            }
        }
        if (a.v_ckpt && t0 + CHUNK < T) {  // the state the next chunk starts from
            const index_t c = (t0 / CHUNK) * N + first;
            for (int k = 0; k < WINDOW; ++k)
                a.v_ckpt[c + window_offset(a, k)] = v[k];
        }
    }
}

// dL/dS[t] of neuron n, one pack of VEC: as given, or in pooled kernels the gradient of the
// output element `slot` shared by its window's neurons, divided by WINDOW in the storage dtype
// (what the average pooling's backward writes for each of them).
template <class Args>
__device__ __forceinline__ pack_t grad_spike_pack(const Args& a, const index_t t,
                                                  const index_t n, const index_t slot)
{
    if constexpr (POOL > 1) {
        pack_t g;
        const float pooled = to_float(a.grad_spike_seq[t * (a.N / WINDOW) + slot]);
        g.e[0] = from_float(pooled * (1.0f / WINDOW));
        return g;
    } else {
        return load_pack(a.grad_spike_seq, t * a.N + n);
    }
}

// The learnable parameters' gradients of the whole launch from each thread's acc: summed per
// block (warp shuffles, then shared memory), written to grad_learnable_partial [P, blocks];
// the last block to finish (counted in blocks_done, which the launcher zeroes) sums those in
// block order into grad_learnable [P]. Deterministic: the same bits whichever block is last.
template <class Args>
__device__ void sum_learnable_grads(const Args& a, const float (&acc)[LEARNABLE_SLOTS])
{
    __shared__ float warp_sums[LEARNABLE_SLOTS][BLOCK_THREADS / 32];
    __shared__ bool last_block;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const index_t blocks = (index_t)gridDim.x * gridDim.y;
    for (int i = 0; i < N_LEARNABLE; ++i) {
        float s = acc[i];
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_down_sync(0xffffffff, s, o);
        if (lane == 0)
            warp_sums[i][warp] = s;
    }
    __syncthreads();
    if ((int)threadIdx.x < N_LEARNABLE) {
        float s = 0.0f;
        for (int w = 0; w < warps; ++w)
            s += warp_sums[threadIdx.x][w];
        a.grad_learnable_partial[threadIdx.x * blocks + blockIdx.y * gridDim.x + blockIdx.x] = s;
        __threadfence();  // visible to the last block before this block is counted
    }
    __syncthreads();
    if (threadIdx.x == 0)
        last_block = atomicAdd(a.blocks_done, 1u) == blocks - 1;
    __syncthreads();
    if (!last_block)
        return;
    for (int i = 0; i < N_LEARNABLE; ++i) {
        float s = 0.0f;
        for (index_t b = threadIdx.x; b < blocks; b += blockDim.x)
            s += __ldcg(a.grad_learnable_partial + i * blocks + b);  // from L2: other SMs wrote it
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_down_sync(0xffffffff, s, o);
        if (lane == 0)
            warp_sums[i][warp] = s;  // read above before the last __syncthreads: free again
    }
    __syncthreads();
    if ((int)threadIdx.x < N_LEARNABLE) {
        float s = 0.0f;
        for (int w = 0; w < warps; ++w)
            s += warp_sums[threadIdx.x][w];
        a.grad_learnable[threadIdx.x] = s;
    }
}

// Where affine pass 1 also writes g = dL/dX in the storage dtype (null: it does not): what
// pass 2 then reads element by element (spikefuse/cuda/affine_grad.cuh) instead of walking the
// neurons through time again, a pass bound by instruction issue with 16-bit storage.
template <class Args>
__device__ __forceinline__ scalar_t* kept_grad_input(const Args& a)
{
    if constexpr (KEEPS_INPUT_GRAD)
        return a.grad_input_seq;
    return nullptr;
}

// Backward through time: dL/dX[t] (affine pass 2: dL/dY[t]; pass 1: per-neuron, per-window or
// per-tile sums for BatchNorm, and dL/dX[t] where kept_grad_input), dL/dV[-1] (and
// dL/dW[-1]), the learnable parameters' gradients. PASS1: the affine kernels' pass 1,
// compiled apart from pass 2 so that neither computes what only the other writes (the
// backward is bound by instruction issue).
template <class Args, bool PASS1>
__device__ __forceinline__ void neuron_bptt(const Args& a)
{
    constexpr bool SUMS = AFFINE && PASS1;  // BatchNorm's sums (and the learnable gradients)
    constexpr bool WRITES = !SUMS;  // dL/dX (affine: dL/dY)
    constexpr bool LEARNS = N_LEARNABLE > 0 && (SUMS || !AFFINE);
    const int T = (int)a.T;
    // The thread's first slot: neurons first .. first + VEC - 1, or (pooled) output element
    // first; channel-tiled threads walk more slots of the same channel (bptt_next_slot).
    const index_t N = a.N, first = bptt_first_neuron(a), x_step = x_step_of(a);
    const bool active = first < N / WINDOW;
    const auto p = load_params(a);
    // Affine kernels: this thread's neurons' channels, and BatchNorm's backward through the
    // batch statistics from the channel totals: dL/dY = scale g + coef_y Y + coef_0
    // (see spikefuse.fused.ops.bn_neuron); zero coefficients with running statistics.
    float scale[VEC], shift[VEC], mean[VEC], coef_y[VEC], coef_0[VEC], sum_g[VEC], sum_gy[VEC];
    if constexpr (AFFINE)
        for (int k = 0; k < VEC && active; ++k) {
            const index_t c = channel_tiled(a) ? blockIdx.x * 32 + threadIdx.x % 32
                                                 : (first + k) / a.inner % a.channels;
            channel_affine(a, c, scale[k], shift[k]);
            mean[k] = a.bn_mean[c];
            coef_y[k] = coef_0[k] = sum_g[k] = sum_gy[k] = 0.0f;
            if (WRITES && a.bn_total_g) {
                const float invstd = a.bn_invstd[c];
                const float mean_g = a.bn_total_g[c] * a.inv_count;
                const float mean_gxhat = a.bn_total_gy[c] * invstd * a.inv_count;
                coef_y[k] = -scale[k] * invstd * mean_gxhat;
                coef_0[k] = -scale[k] * mean_g - mean[k] * coef_y[k];
            }
        }
    float acc[LEARNABLE_SLOTS] = {0.0f};  // dL/dp over this thread's neurons and steps
    // With Y repeated over time (x_step 0) pass 2's dL/dY and pass 1's kept dL/dX are summed
    // over T, written once per neuron; the other kernels write every step.
    const bool per_step = !AFFINE || x_step != 0;
    scalar_t* const kept_g = kept_grad_input(a);
    float grad_total[VEC];  // pass 2: of dL/dY; pass 1: of dL/dX
    // Carried from step t+1 to step t: the gradient reaching V[t] (and W[t]) from later steps.
    float grad_v_carry[VEC], grad_w_carry[VEC];
    for (index_t slot = first; slot < N / WINDOW; slot = bptt_next_slot(a, slot)) {
        // One walk through time per neuron of the slot (pooled kernels: per neuron of the window,
        // summing BatchNorm's sums and the learnable gradients over them).
        for (int walk = 0; walk < WINDOW; ++walk) {
            const index_t n = walked_neuron(a, slot, walk);
            for (int k = 0; k < VEC; ++k) {
                grad_total[k] = 0.0f;
                grad_v_carry[k] = 0.0f;
                if constexpr (!AFFINE)
                    if (a.grad_v_last)
                        grad_v_carry[k] = a.grad_v_last[n + k];
                if constexpr (ADAPTIVE)
                    grad_w_carry[k] = a.grad_w_last ? a.grad_w_last[n + k] : 0.0f;
            }
            for (int t0 = (T - 1) / CHUNK * CHUNK; t0 >= 0; t0 -= CHUNK) {
                // element (t0, n); step j of the chunk is base + j*N (of x_seq: x_base + j*x_step)
                const index_t base = t0 * N + n, x_base = t0 * x_step + n;
                // State at the chunk's start (V[t0-1], W[t0-1]): the forward's checkpoint, or
                // V[-1].
                float v_start[VEC], w_start[VEC];
                const index_t c = (t0 / CHUNK - 1) * N + n;
                for (int k = 0; k < VEC; ++k) {
                    v_start[k] = t0 ? a.v_ckpt[c + k] : initial_v(a, n + k);
                    if constexpr (ADAPTIVE)
                        w_start[k] = t0 ? a.w_ckpt[c + k] : initial_w(a, n + k);
                    else
                        w_start[k] = 0.0f;
                }
                // the chunk's steps (all CHUNK but in the last chunk), compared with the constant j
                const int steps = min(CHUNK, T - t0);
                // the chunk's loads first: independent, so they overlap
                pack_t xp[CHUNK], gsp[CHUNK], rp[CHUNK];
#pragma unroll
                for (int j = 0; j < CHUNK; ++j) {
                    if (j >= steps)
                        break;
                    xp[j] = load_pack(a.x_seq, x_base + j * x_step);
                    gsp[j] = grad_spike_pack(a, t0 + j, n, slot);
                    if constexpr (RESIDUAL)
                        rp[j] = load_pack(a.residual_seq, base + j * N);
                }
                // Recompute the chunk as forward did: H[t] (and W[t]) into registers.
                float hc[CHUNK][VEC], wc[CHUNK][VEC];
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    float v = v_start[k], w = w_start[k];
#pragma unroll
                    for (int j = 0; j < CHUNK; ++j) {
                        if (j >= steps)
                            break;
                        const float x = neuron_input(
                            to_float(xp[j].e[k]), scale, shift, k, residual_at(rp[j], k));
                        hc[j][k] = step(v, w, x, p);
                        wc[j][k] = w;
                    }
                }
                // Walk the chunk backwards (seed 003):
                //   dL/dH[t] = dL/dS[t] Θ' + dL/dV[t] dV[t]/dH[t]
                //              (+ dL/dW[t] (∂Z[t]/∂H[t] + jump Θ'))
#pragma unroll
                for (int j = CHUNK - 1; j >= 0; --j) {
                    if (j >= steps)
                        continue;
                    pack_t gxp, gvp, grp;
                    if constexpr (!AFFINE)
                        if (a.grad_v_seq)
                            gvp = load_pack(a.grad_v_seq, base + j * N);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) {
                        const float h = hc[j][k];
                        const float y = to_float(xp[j].e[k]);  // X, or Y in the affine kernels
                        const float x = neuron_input(y, scale, shift, k, residual_at(rp[j], k));
                        // The state step t started from: the chunk's start, or step t-1's result.
                        const float v_prev = j == 0 ? v_start[k] : reset(hc[j - 1][k], p);
                        const float w_prev = j == 0 ? w_start[k] : wc[j - 1][k];
                        const float spike = h >= p.v_threshold ? 1.0f : 0.0f;
                        const float sg = surrogate_grad(h - p.v_threshold);
                        // dL/dV[t]: from step t+1, plus the V sequence's (if v_seq; affine: none)
                        float grad_v = grad_v_carry[k];
                        if constexpr (!AFFINE)
                            if (a.grad_v_seq)
                                grad_v += to_float(gvp.e[k]);
                        // Gradients need not match torch bit for bit (forward's H does): FMAs here
                        float grad_h = fmaf(grad_v, dv_dh(h, spike, sg, p),
                                            to_float(gsp[j].e[k]) * sg);
                        if constexpr (ADAPTIVE) {
                            const float grad_w = grad_w_carry[k];  // dL/dW[t]
                            grad_h += grad_w
                                    * (dz_dh(v_prev, x, w_prev, h, p) + adaptation_jump(p) * sg);
                            grad_w_carry[k] = grad_h * dh_dw(v_prev, x, w_prev, h, p)
                                            + grad_w * dz_dw(v_prev, x, w_prev, h, p);
                        }
                        const float grad_x = grad_h * dh_dx(v_prev, x, w_prev, h, p);
                        if constexpr (SUMS) {
                            sum_g[k] += grad_x;
                            sum_gy[k] = fmaf(grad_x, y - mean[k], sum_gy[k]);
                            gxp.e[k] = from_float(grad_x);  // dL/dX, where kept
                            if constexpr (!RESIDUAL)  // dL/dR is per step: never summed
                                grad_total[k] += grad_x;
                        } else if constexpr (AFFINE) {
                            const float grad_y =
                                fmaf(scale[k], grad_x, fmaf(coef_y[k], y, coef_0[k]));
                            gxp.e[k] = from_float(grad_y);  // dL/dY
                            grad_total[k] += grad_y;
                            if constexpr (RESIDUAL)
                                grp.e[k] = from_float(grad_x);  // dL/dR
                        } else {
                            gxp.e[k] = from_float(grad_x);
                        }
                        grad_v_carry[k] = grad_h * dh_dv(v_prev, x, w_prev, h, p);  // to V[t-1]
                        if constexpr (LEARNS)
                            add_learnable_grads(acc, grad_h, v_prev, x, w_prev, h, p);
                    }
                    if constexpr (WRITES) {
                        if (per_step)
                            store_pack(a.grad_x_seq, base + j * N, gxp);
                    } else if (kept_g && per_step) {
                        store_pack(kept_g, base + j * N, gxp);
                    }
                    if constexpr (RESIDUAL && WRITES)
                        store_pack(a.grad_residual_seq, base + j * N, grp);
                }
            }
            scalar_t* const total_out = WRITES ? a.grad_x_seq : (RESIDUAL ? nullptr : kept_g);
            if constexpr (AFFINE && POOL == 1)
                if (!per_step && total_out) {
                    pack_t total;
                    for (int k = 0; k < VEC; ++k)
                        total.e[k] = from_float(grad_total[k]);
                    store_pack(total_out, n, total);
                }
        }
        for (int k = 0; k < VEC; ++k) {
            if constexpr (!AFFINE)
                if (a.grad_v0)
                    a.grad_v0[slot + k] = grad_v_carry[k];
            if constexpr (ADAPTIVE)
                if (a.grad_w0)
                    a.grad_w0[slot + k] = grad_w_carry[k];
            if constexpr (SUMS)  // pooled kernels: the window's sums (their only slot)
                if (!a.channel_tiles) {
                    a.grad_sum[slot + k] = sum_g[k];
                    a.grad_dot[slot + k] = sum_gy[k];
                }
        }
    }
    if constexpr (SUMS && VEC == 1)
        if (a.channel_tiles)  // the same for the whole block: it may synchronise
            block_channel_sums(a, active, sum_g[0], sum_gy[0]);
    if constexpr (LEARNS)
        if (a.grad_learnable_partial)  // the same for the whole block: it may synchronise
            sum_learnable_grads(a, acc);
}

// Forward of the variant (a template, so that the other one is never instantiated).
template <class Args>
__device__ __forceinline__ void fptt(const Args& a)
{
    if constexpr (POOL > 1)
        neuron_fptt_pooled(a);
    else
        neuron_fptt(a);
}

// The entry points, named by the prelude (kernel names say the variant, as profilers show).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, FPTT_MIN_BLOCKS)
    FPTT_KERNEL(const Args a)
{
    fptt(a);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS) BPTT_KERNEL(const Args a)
{
    if constexpr (AFFINE) {  // pass 1 writes no dL/dY (see neuron_bptt)
        if (a.grad_x_seq)
            neuron_bptt<Args, false>(a);
        else
            neuron_bptt<Args, true>(a);
    } else {
        neuron_bptt<Args, false>(a);
    }
}

#undef FPTT_KERNEL
#undef BPTT_KERNEL
