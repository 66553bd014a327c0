// spikefuse BN-folded backward pass 2 from pass 1's dL/dX: dL/dY element by element.
//
// spikefuse/cuda/affine_grad.py compiles this file once per storage dtype, vector width and
// index width, after a prelude that defines scalar_t, to_float and from_float (the neuron
// kernels' storage declarations), index_t, VEC (elements per thread and iteration),
// BLOCK_THREADS and GRAD_KERNEL (the entry point's name).
//
// Element i of channel c = (i / inner) % channels (the neuron kernels' layout) gets
//   dL/dY = scale[c] g + steps (coef_y[c] Y + coef_0[c]),   scale = invstd gamma,
// with BatchNorm's batch-statistics coefficients from the channel totals of pass 1's sums
// (bn_total_g/gy; null with running statistics: both coefficients 0), computed as the neuron
// kernels' pass 2 computes them (spikefuse/cuda/neuron_kernels.cuh: neuron_bptt), and steps
// the time steps whose g pass 1 summed (T for a Y repeated over time, else 1). Compiled, as
// the neuron kernels are, without FMA contraction: the coefficients are the same bits.
//
// g, Y and dL/dY share one layout. dL/dY may be g's or Y's memory: each thread reads its
// elements before it writes them, and no other thread touches them. A thread walks packs of
// VEC elements BLOCK_THREADS * gridDim.x packs apart and loads its channels' coefficients
// again only where the channel of its pack changes (never, where the launcher makes that
// stride a multiple of the channels).

struct Args {
    const scalar_t* grad_input;  // g = dL/dX [M]
    const scalar_t* y;           // Y [M]
    scalar_t* grad_y;            // dL/dY [M]
    const float* bn_mean;        // [C]
    const float* bn_invstd;      // [C]
    const float* bn_weight;      // [C] gamma, or null (1)
    const float* bn_total_g;     // [C] channel total of g, or null (running statistics)
    const float* bn_total_gy;    // [C] channel total of g (Y - mean)
    index_t M, channels, inner;  // elements; channel of element i: i / inner % channels
    float inv_count;             // 1 / elements per channel
    float steps;                 // steps summed into g: T (Y repeated over time), else 1
};

struct alignas(sizeof(scalar_t) * VEC) pack_t {
    scalar_t e[VEC];
};

// dL/dY = scale g + coef_y Y + coef_0 of channel c (neuron_bptt's formulas).
__device__ __forceinline__ void coefficients(const Args& a, const index_t c, float& scale,
                                             float& coef_y, float& coef_0)
{
    const float invstd = a.bn_invstd[c];
    scale = a.bn_weight ? invstd * a.bn_weight[c] : invstd;
    coef_y = coef_0 = 0.0f;
    if (a.bn_total_g) {
        const float mean_g = a.bn_total_g[c] * a.inv_count;
        const float mean_gxhat = a.bn_total_gy[c] * invstd * a.inv_count;
        coef_y = -scale * invstd * mean_gxhat;
        coef_0 = -scale * mean_g - a.bn_mean[c] * coef_y;
    }
}

// VEC > 1 only where inner is 1 and channels a multiple of VEC: a pack's channels follow its
// first one's.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) GRAD_KERNEL(const Args a)
{
    const index_t stride = (index_t)gridDim.x * BLOCK_THREADS * VEC;
    index_t loaded = -1;  // the channel whose coefficients the registers hold
    float scale[VEC], coef_y[VEC], coef_0[VEC];
    for (index_t i = ((index_t)blockIdx.x * BLOCK_THREADS + threadIdx.x) * VEC; i < a.M;
         i += stride) {
        const pack_t g = *reinterpret_cast<const pack_t*>(a.grad_input + i);
        const pack_t y = *reinterpret_cast<const pack_t*>(a.y + i);
        const index_t c = i / a.inner % a.channels;
        if (c != loaded) {
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                coefficients(a, c + k, scale[k], coef_y[k], coef_0[k]);
            loaded = c;
        }
        pack_t out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float terms = a.steps * fmaf(coef_y[k], to_float(y.e[k]), coef_0[k]);
            out.e[k] = from_float(fmaf(scale[k], to_float(g.e[k]), terms));
        }
        *reinterpret_cast<pack_t*>(a.grad_y + i) = out;
    }
}
