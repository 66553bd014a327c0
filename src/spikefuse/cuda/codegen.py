"""CUDA source generation: forward-through-time and BPTT kernels for one neuron program.

One thread owns ``VEC`` neighbouring neurons and walks all T steps for them, with one vector load
or store per tensor and step. Storage is float32, float16 or bfloat16; arithmetic is float32.

Traffic is five passes over [T, N]: forward reads X and writes S; backward reads X and dL/dS and
writes dL/dX. Forward saves nothing per step: only V (and W) at the end of every chunk of
``CHUNK`` steps (``AFFINE_CHUNK`` for the channel-affine kernels), in float32. Backward walks the
chunks from last to first; for each it recomputes the chunk's H[t] from X with the forward's own
``step`` function (so in every storage dtype it sees exactly the forward's float32 H and spikes),
keeps them in registers, and walks the chunk backwards with seed 003's dL/dH recurrence.
Learnable-parameter gradients are reduced per block into a [P, blocks] buffer, summed afterwards
in a fixed order (same bits on every run).

Channel-affine variants fold BatchNorm in (fused blocks): the neuron's input is
X = Y * scale[c] + shift[c] (one FMA; each thread computes scale and shift from BatchNorm's mean,
1/std, gamma and beta), and backward writes either the per-neuron sums over t of dL/dX and
dL/dX * (Y - mean[c]) that BatchNorm's backward reduces per channel (pass 1), or dL/dY, with
BatchNorm's coefficients computed per thread from those channel totals (pass 2).

Both kernels take one argument, an ``Args`` struct (layout in :data:`ARG_POINTERS`), so a launch
packs a single buffer. Extension path (as in SpikingJelly's kernel templates): subclass
:class:`NeuronKernel` and return CUDA expressions from :meth:`~NeuronKernel.charge`,
:meth:`~NeuronKernel.dh_dx` and :meth:`~NeuronKernel.dh_dv` (and the two-state snippets for
adaptive neurons). Expressions may use ``v`` (V[t-1]), ``x`` (X[t]), ``w`` (W[t-1]), ``h`` (H[t],
derivatives only) and ``p.<param>``. :class:`DefinitionKernel` prints every snippet from a
:class:`~spikefuse.program.NeuronProgram`.
"""

from __future__ import annotations

import struct

import sympy as sp
import torch

from ..program import NeuronProgram
from ..surrogate import Surrogate
from .printer import EXACT_DIV, cuda_expr

BLOCK_THREADS = 256
CHUNK = 8  # steps whose H stays in registers while backward walks them
# Chunk of the channel-affine kernels (one neuron per thread in backward). With 16-bit storage a
# float32 checkpoint costs 2/CHUNK of Y's bytes, so they take 16 steps (no checkpoint at all for
# T <= 16; their backward is issue-bound and barely slows); float32 keeps 8, where the longer
# chunk's registers cost a quarter of the backward's occupancy and 25% of its time (H200).
AFFINE_CHUNK = {torch.float32: 8, torch.float16: 16, torch.bfloat16: 16}
LOAD_STEPS = 8  # forward: steps of input loaded ahead at once (a CHUNK's worth at most)
VEC = 4  # neurons per thread when N and the pointers allow (16-byte fp32 / 8-byte 16-bit access)
# Backward with 16-bit storage is bound by instruction issue, not memory: one neuron per thread
# and more resident blocks ran it fastest on an H200 (bf16, T=32: 157 us vs 200 us with VEC).
BPTT_VEC = {torch.float32: VEC, torch.float16: 1, torch.bfloat16: 1}
# The channel-affine backward holds 7 more values per neuron (its channel's vectors and sums):
# with VEC = 4 it spills registers, with one neuron per thread it fits in 64.
AFFINE_BPTT_VEC = 1
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")  # no FMA contraction: H matches torch's bitwise

_STORAGE = {
    torch.float32: ("float", "", "x", "x"),
    torch.float16: ("__half", "#include <cuda_fp16.h>", "__half2float(x)", "__float2half_rn(x)"),
    torch.bfloat16: (
        "__nv_bfloat16",
        "#include <cuda_bf16.h>",
        "__bfloat162float(x)",
        "__float2bfloat16_rn(x)",
    ),
}

# (C type, name, comment) of the pointer fields of ``Args``, in order; null where unused.
ARG_POINTERS = (
    ("const scalar_t*", "x_seq", "X [T, N]"),
    ("const float*", "v0", "V[-1] [N], or null: every neuron starts at v_init"),
    ("const float*", "w0", "W[-1] [N], or null: every neuron starts at w_init"),
    ("scalar_t*", "spike_seq", "S [T, N]"),
    ("scalar_t*", "v_seq", "V [T, N], or null"),
    ("float*", "v_last", "V[T-1] [N], or null"),
    ("float*", "w_last", "W[T-1] [N], or null"),
    ("float*", "v_ckpt", "V at the end of each chunk but the last [ceil(T/CHUNK)-1, N], or null"),
    ("float*", "w_ckpt", "W likewise"),
    ("const float*", "learnable", "learnable parameter values [P]"),
    ("const scalar_t*", "grad_spike_seq", "dL/dS [T, N]"),
    ("const scalar_t*", "grad_v_seq", "dL/dV [T, N], or null"),
    ("const float*", "grad_v_last", "dL/dV[T-1] [N], or null"),
    ("const float*", "grad_w_last", "dL/dW[T-1] [N], or null"),
    ("scalar_t*", "grad_x_seq", "dL/dX [T, N]"),
    ("float*", "grad_v0", "dL/dV[-1] [N], or null"),
    ("float*", "grad_w0", "dL/dW[-1] [N], or null"),
    ("float*", "grad_learnable_partial", "per-block sums of dL/dp [P, blocks], or null"),
    # Channel-affine kernels only (BatchNorm folded in): x_seq holds Y, and the neuron's input is
    # X = Y * scale[c] + shift[c], scale = invstd * gamma, shift = beta - mean * scale, with
    # c = (n / inner) % channels. Backward pass 1 writes the per-neuron sums; pass 2 reads their
    # per-channel totals (divided by the count through inv_count) and writes dL/dY.
    ("const float*", "bn_mean", "[C] per-channel mean of Y"),
    ("const float*", "bn_invstd", "[C] 1 / sqrt(var + eps)"),
    ("const float*", "bn_weight", "[C] gamma, or null (1)"),
    ("const float*", "bn_bias", "[C] beta, or null (0)"),
    ("float*", "grad_sum", "sum over t of dL/dX [N], or null"),
    ("float*", "grad_dot", "sum over t of dL/dX (Y - bn_mean[c]) [N], or null"),
    ("const float*", "bn_total_g", "[C] channel total of grad_sum, or null: running statistics"),
    ("const float*", "bn_total_gy", "[C] channel total of grad_dot"),
)
POINTER_NAMES = tuple(name for _, name, _ in ARG_POINTERS)


def _storage_helpers(dtype: torch.dtype) -> str:
    ctype, include, to_f, from_f = _STORAGE[dtype]
    return f"""\
{include}
typedef {ctype} scalar_t;
__device__ __forceinline__ float to_float(const scalar_t x) {{ return {to_f}; }}
__device__ __forceinline__ scalar_t from_float(const float x) {{ return {from_f}; }}"""


class NeuronKernel:
    """Template of a neuron's fused FPTT and BPTT kernels; subclasses supply the neuron snippets.

    Args:
        name: kernel name prefix (identifier).
        params: names of the float parameters (``p.<name>`` in snippets), besides the built-ins
            ``v_threshold`` and ``v_reset``, in argument order.
        learnable: those of ``params`` read from a device array (gradients are computed for them).
        surrogate: the spike's surrogate; its :meth:`~Surrogate.cuda_code` is emitted.
        hard_reset, detach_reset: reset rule.
        dtype: storage dtype (float32, float16 or bfloat16).
        vec: neurons per thread (vector width of loads and stores).
        adaptive: two-state neuron (W); then the adaptation snippets must be given too.
        affine: fold a per-channel affine map into the kernels (BatchNorm; one-state neurons):
            forward reads Y and feeds X = Y * scale[c] + shift[c] to the neuron; backward
            recomputes X the same way and writes dL/dY (an affine map of dL/dX per channel)
            and/or the per-neuron sums over t that BatchNorm's backward reduces per channel.
    """

    def __init__(
        self,
        name: str,
        params: tuple[str, ...],
        learnable: tuple[str, ...],
        surrogate: Surrogate,
        hard_reset: bool,
        detach_reset: bool,
        dtype: torch.dtype,
        vec: int = 1,
        adaptive: bool = False,
        affine: bool = False,
    ) -> None:
        if dtype not in _STORAGE:
            raise ValueError(f"unsupported storage dtype {dtype}")
        if affine and adaptive:
            raise ValueError(f"{name}: channel-affine kernels are for one-state neurons")
        self.name, self.params, self.learnable = name, params, learnable
        self.surrogate, self.hard_reset, self.detach_reset = surrogate, hard_reset, detach_reset
        self.dtype, self.vec, self.adaptive, self.affine = dtype, vec, adaptive, affine
        self.chunk = AFFINE_CHUNK[dtype] if affine else CHUNK
        tag = f"{'hard' if hard_reset else 'soft'}{'_detach' if detach_reset else ''}"
        tag += "_affine" if affine else ""
        self.kernel_prefix = f"{name}_{tag}_{_STORAGE[dtype][0].strip('_')}_v{vec}"
        self.constant_names = tuple(
            n for n in ("v_threshold", "v_reset", *params) if n not in learnable
        )
        clash = set(params) & {*POINTER_NAMES, "T", "N", "channels", "inner", "v_init", "w_init"}
        if clash:
            raise ValueError(f"{name}: parameter names {sorted(clash)} are reserved by the kernels")
        # Args as bytes: pointers, T, N, channels, inner (8 bytes each), then floats; padded to 8.
        n_floats = 3 + len(self.constant_names)
        self.arg_layout = struct.Struct(f"<{len(ARG_POINTERS)}Q4q{n_floats}f{4 * (n_floats % 2)}x")

    # ---- neuron snippets (CUDA float expressions) -------------------------------------------
    def charge(self) -> str:
        """H[t] from v, x (and w)."""
        raise NotImplementedError

    def dh_dx(self) -> str:
        """∂H/∂X at (v, x, w, h)."""
        raise NotImplementedError

    def dh_dv(self) -> str:
        """∂H/∂V[t-1] at (v, x, w, h)."""
        raise NotImplementedError

    def dh_dparam(self, name: str) -> str:
        """∂H/∂p for a learnable parameter p."""
        raise NotImplementedError

    def dh_dw(self) -> str:
        """∂H/∂W[t-1] (two-state neurons)."""
        raise NotImplementedError

    def adaptation(self) -> str:
        """Z[t] from v, x, w and h (two-state neurons)."""
        raise NotImplementedError

    def adaptation_jump(self) -> str:
        """Spike-triggered increment of W (two-state neurons)."""
        raise NotImplementedError

    def dz_dh(self) -> str:
        raise NotImplementedError

    def dz_dw(self) -> str:
        raise NotImplementedError

    # ---- assembly ------------------------------------------------------------------------------
    @property
    def fptt_name(self) -> str:
        return f"{self.kernel_prefix}_fptt"

    @property
    def bptt_name(self) -> str:
        return f"{self.kernel_prefix}_bptt"

    def pack_args(self, pointers: dict[str, int], T: int, N: int, v_init: float,
                  w_init: float, constants: list[float], channels: tuple[int, int] = (1, 1),
                  inv_count: float = 0.0) -> bytes:  # fmt: skip
        """The ``Args`` struct as bytes; absent pointers are null. ``channels`` is
        (channels, inner) of the channel-affine kernels: c = (n / inner) % channels;
        ``inv_count`` scales ``bn_total_*`` to per-channel means (1 / elements per channel)."""
        ptrs = [pointers.get(name, 0) for name in POINTER_NAMES]
        return self.arg_layout.pack(*ptrs, T, N, *channels, v_init, w_init, inv_count, *constants)

    def _args_struct(self) -> str:
        lines = [f"    {ctype} {name};  // {doc}" for ctype, name, doc in ARG_POINTERS]
        lines.append("    long long T, N, channels, inner;")
        lines.append("    float v_init, w_init;  // initial V and W where v0 / w0 are null")
        lines.append("    float inv_count;  // affine backward: 1 / elements per channel")
        lines += [f"    float {n};" for n in self.constant_names]
        return "struct Args {\n" + "\n".join(lines) + "\n};"

    def _params(self) -> str:
        names = ("v_threshold", "v_reset", *self.params)
        fields = " ".join(f"float {n};" for n in names)
        rcp_fields = " ".join(f"float rcp_{n};" for n in self.params)
        loads = "".join(
            f"\n    p.{n} = {f'a.learnable[{self.learnable.index(n)}]' if n in self.learnable else f'a.{n}'};"
            for n in names
        )
        rcps = "".join(f"\n    p.rcp_{n} = __frcp_rn(p.{n});" for n in self.params)
        return f"""\
// Parameters, and the reciprocals of the neuron's own ones (for exact_div; unused ones vanish).
struct Params {{ {fields} {rcp_fields} }};
__device__ __forceinline__ Params load_params(const Args& a) {{
    Params p;{loads}{rcps}
    return p;
}}
{EXACT_DIV}"""

    def _reset(self, h: str, spike: str) -> str:
        if self.hard_reset:
            return f"({spike} ? p.v_reset : {h})"
        return f"({h} - ({spike} ? p.v_threshold : 0.0f))"

    def _device_functions(self) -> str:
        sig = "const float v, const float x, const float w, const float h, const Params& p"
        fn = "__device__ __forceinline__ float"
        funcs = [
            f"{fn} charge(const float v, const float x, const float w, const Params& p) "
            f"{{ return {self.charge()}; }}",
            f"{fn} dh_dx({sig}) {{ return {self.dh_dx()}; }}",
            f"{fn} dh_dv({sig}) {{ return {self.dh_dv()}; }}",
            f"{fn} surrogate_grad(const float x) {{ return {self.surrogate.cuda_code('x')}; }}",
            f"{fn} reset(const float h, const Params& p) "
            f"{{ return {self._reset('h', '(h >= p.v_threshold)')}; }}",
        ]
        funcs += [f"{fn} dh_d{n}({sig}) {{ return {self.dh_dparam(n)}; }}" for n in self.learnable]
        if self.adaptive:
            funcs += [
                f"{fn} dh_dw({sig}) {{ return {self.dh_dw()}; }}",
                f"{fn} adaptation({sig}) {{ return {self.adaptation()}; }}",
                f"{fn} adaptation_jump(const Params& p) {{ return {self.adaptation_jump()}; }}",
                f"{fn} dz_dh({sig}) {{ return {self.dz_dh()}; }}",
                f"{fn} dz_dw({sig}) {{ return {self.dz_dw()}; }}",
            ]
        adapt = (
            "\n    w = adaptation(v, x, w, h, p) + (h >= p.v_threshold ? adaptation_jump(p) : 0.0f);"
            if self.adaptive
            else ""
        )
        funcs.append(
            f"""\
// One step of one neuron, shared by forward and backward's recompute (same float32 results):
// returns H[t]; updates v = V[t-1] -> V[t] and w = W[t-1] -> W[t].
__device__ __forceinline__ float step(float& v, float& w, const float x, const Params& p) {{
    const float h = charge(v, x, w, p);{adapt}
    v = reset(h, p);
    return h;
}}"""
        )
        return "\n".join(funcs)

    def header(self) -> str:
        """Shared preamble: storage helpers, argument struct, vector pack, device functions."""
        return "\n".join(
            [
                f"// spikefuse kernels: {self.name}, surrogate {type(self.surrogate).__name__}"
                f"({self.surrogate.extra_repr()}), "
                f"{'hard' if self.hard_reset else 'soft'} reset, detach_reset={self.detach_reset}",
                _storage_helpers(self.dtype),
                f"constexpr int VEC = {self.vec};  // neurons per thread",
                f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
                # Resident blocks per SM the register budget must allow (measured on an H200):
                # 2 where registers hold more than 8 values of H per thread (CHUNK x VEC), else 4.
                f"constexpr int MIN_BLOCKS = {2 if self.vec * self.chunk > 8 else 4};",
                f"constexpr int CHUNK = {self.chunk};  // steps recomputed into registers by backward",
                f"constexpr int LOAD_STEPS = {LOAD_STEPS};  // steps forward loads ahead at once",
                "struct alignas(sizeof(scalar_t) * VEC) pack_t { scalar_t e[VEC]; };",
                "__device__ __forceinline__ pack_t load_pack(const scalar_t* p, long long i) "
                "{ return *reinterpret_cast<const pack_t*>(p + i); }",
                "__device__ __forceinline__ void store_pack(scalar_t* p, long long i, "
                "const pack_t& v) { *reinterpret_cast<pack_t*>(p + i) = v; }",
                self._args_struct(),
                self._params(),
                self._device_functions(),
            ]
        )

    def _initial_state(self) -> str:
        w = "w[k] = a.w0 ? a.w0[n + k] : a.w_init;" if self.adaptive else "w[k] = 0.0f;"
        return f"for (int k = 0; k < VEC; ++k) {{ v[k] = a.v0 ? a.v0[n + k] : a.v_init; {w} }}"

    def _channel_loads(self, backward: bool) -> str:
        """Per-thread channel vectors of the affine kernels (loaded once, used for all T)."""
        if not self.affine:
            return ""
        names = ["in_a[VEC]", "in_b[VEC]"]
        # The same float32 operations, in the same order, as the torch composite's scale/shift.
        loads = [
            "const float mean = a.bn_mean[c], invstd = a.bn_invstd[c];",
            "in_a[k] = a.bn_weight ? invstd * a.bn_weight[c] : invstd;",
            "in_b[k] = a.bn_bias ? -mean * in_a[k] + a.bn_bias[c] : -mean * in_a[k];",
        ]
        if backward:
            names += ["in_m[VEC]", "coef_y[VEC]", "coef_0[VEC]", "sum_g[VEC]", "sum_gy[VEC]"]
            # BatchNorm's backward through the batch statistics, from the channel totals:
            # dL/dY = scale g + coef_y Y + coef_0 (see spikefuse.fused.bn_neuron).
            loads += [
                "in_m[k] = mean;",
                "coef_y[k] = coef_0[k] = sum_g[k] = sum_gy[k] = 0.0f;",
                "if (a.bn_total_g) {",
                "    const float mean_g = a.bn_total_g[c] * a.inv_count;",
                "    const float mean_gxhat = a.bn_total_gy[c] * invstd * a.inv_count;",
                "    coef_y[k] = -in_a[k] * invstd * mean_gxhat;",
                "    coef_0[k] = -in_a[k] * mean_g - mean * coef_y[k];",
                "}",
            ]
        body = "\n".join(f"        {line}" for line in loads)
        return f"""
    // This thread's neurons' channels: X = Y * in_a + in_b (BatchNorm folded into the input).
    float {", ".join(names)};
    for (int k = 0; k < VEC && n < N; ++k) {{
        const long long c = (n + k) / a.inner % a.channels;
{body}
    }}"""

    def _input(self, loaded: str) -> str:
        """The neuron's input X (float) from a loaded storage value."""
        if self.affine:
            return f"__fmaf_rn(to_float({loaded}), in_a[k], in_b[k])"
        return f"to_float({loaded})"

    def fptt_source(self) -> str:
        """The forward kernel: S[t], V[t] (store_v_seq), chunk-end checkpoints, last V (and W)."""
        w_ckpt = "if (a.w_ckpt) a.w_ckpt[c + k] = w[k];" if self.adaptive else ""
        w_last = "if (a.w_last) a.w_last[n + k] = w[k];" if self.adaptive else ""
        body = f"""
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS) {self.fptt_name}(const Args a)
{{
    const int T = (int)a.T;
    const long long N = a.N, n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (n >= N) return;
    const Params p = load_params(a);{self._channel_loads(backward=False)}
    float v[VEC], w[VEC];
    {self._initial_state()}
    for (int t0 = 0; t0 < T; t0 += CHUNK) {{
        for (int g = t0; g < t0 + CHUNK && g < T; g += LOAD_STEPS) {{
            const long long base = g * N + n;  // element (g, n); step j is base + j*N
            pack_t xp[LOAD_STEPS];  // the group's loads first: independent, so they overlap
            #pragma unroll
            for (int j = 0; j < LOAD_STEPS; ++j)
                if (g + j < T) xp[j] = load_pack(a.x_seq, base + j * N);
            #pragma unroll
            for (int j = 0; j < LOAD_STEPS; ++j) {{
                if (g + j >= T) break;
                pack_t sp, vp;
                #pragma unroll
                for (int k = 0; k < VEC; ++k) {{
                    const float h = step(v[k], w[k], {self._input("xp[j].e[k]")}, p);
                    // a NaN H gives a NaN spike, never a valid "no spike" (the NaN policy)
                    sp.e[k] = from_float(h >= p.v_threshold ? 1.0f : (isnan(h) ? h : 0.0f));
                    vp.e[k] = from_float(v[k]);
                }}
                store_pack(a.spike_seq, base + j * N, sp);
                if (a.v_seq) store_pack(a.v_seq, base + j * N, vp);
            }}
        }}
        if (a.v_ckpt && t0 + CHUNK < T) {{  // the state the next chunk starts from
            const long long c = (t0 / CHUNK) * N + n;
            for (int k = 0; k < VEC; ++k) {{ a.v_ckpt[c + k] = v[k]; {w_ckpt} }}
        }}
    }}
    for (int k = 0; k < VEC; ++k) {{ if (a.v_last) a.v_last[n + k] = v[k]; {w_last} }}
}}
"""
        return self.header() + body

    def bptt_source(self) -> str:
        """The backward kernel: dL/dX[t], dL/dV[-1] (dL/dW[-1]), per-block learnable gradients."""
        n_learn = len(self.learnable)
        # dV[t]/dH[t]; with detach_reset the reset's dependence on S is cut (seed 003's D_reset).
        if self.hard_reset:
            dv_dh = "1.0f - spike" if self.detach_reset else "1.0f - spike + (p.v_reset - h) * sg"
        else:
            dv_dh = "1.0f" if self.detach_reset else "1.0f - p.v_threshold * sg"
        adaptive = self.adaptive
        w_start = (
            "w_start[k] = t0 ? a.w_ckpt[c + k] : (a.w0 ? a.w0[n + k] : a.w_init);"
            if adaptive
            else "w_start[k] = 0.0f;"
        )
        learn_acc = "".join(
            f"\n                acc[{i}] += grad_h * dh_d{name}(v_prev, x, w_prev, h, p);"
            for i, name in enumerate(self.learnable)
        )
        adaptive_grad = ""
        if adaptive:
            adaptive_grad = """
                const float grad_w = grad_w_carry[k];  // dL/dW[t]
                grad_h += grad_w * (dz_dh(v_prev, x, w_prev, h, p) + adaptation_jump(p) * sg);
                grad_w_carry[k] = grad_h * dh_dw(v_prev, x, w_prev, h, p)
                                + grad_w * dz_dw(v_prev, x, w_prev, h, p);"""
        init_w = (
            "grad_w_carry[k] = a.grad_w_last ? a.grad_w_last[n + k] : 0.0f;" if adaptive else ""
        )
        w0_grad = "if (a.grad_w0) a.grad_w0[n + k] = grad_w_carry[k];" if adaptive else ""
        load_x = ", x = to_float(xp[j].e[k])"
        store_grad = (
            "                gxp.e[k] = from_float(grad_h * dh_dx(v_prev, x, w_prev, h, p));"
        )
        sums = ""
        if self.affine:
            load_x = ";\n                const float y = to_float(xp[j].e[k]), x = __fmaf_rn(y, in_a[k], in_b[k])"
            store_grad = """\
                const float grad_x = grad_h * dh_dx(v_prev, x, w_prev, h, p);
                sum_g[k] += grad_x;
                sum_gy[k] += grad_x * (y - in_m[k]);
                gxp.e[k] = from_float(in_a[k] * grad_x + coef_y[k] * y + coef_0[k]);  // dL/dY"""
            sums = "\n            if (a.grad_sum) { a.grad_sum[n + k] = sum_g[k]; a.grad_dot[n + k] = sum_gy[k]; }"
        reduce = ""
        if n_learn:
            reduce = f"""
    // Deterministic reduction: warp shuffle, then shared memory, one partial per block.
    __shared__ float partial[{n_learn}][{BLOCK_THREADS // 32}];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int i = 0; i < {n_learn}; ++i) {{
        float s = acc[i];
        for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xffffffff, s, o);
        if (lane == 0) partial[i][warp] = s;
    }}
    __syncthreads();
    if (a.grad_learnable_partial && threadIdx.x < {n_learn}) {{
        float s = 0.0f;
        for (int i = 0; i < blockDim.x / 32; ++i) s += partial[threadIdx.x][i];
        a.grad_learnable_partial[(long long)threadIdx.x * gridDim.x + blockIdx.x] = s;
    }}"""
        body = f"""
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS) {self.bptt_name}(const Args a)
{{
    const int T = (int)a.T;
    const long long N = a.N, n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const Params p = load_params(a);{self._channel_loads(backward=True)}
    {f"float acc[{n_learn}] = {{0.0f}};" if n_learn else ""}
    // Carried from step t+1 to step t: the gradient reaching V[t] (and W[t]) from later steps.
    float grad_v_carry[VEC]{", grad_w_carry[VEC]" if adaptive else ""};
    if (n < N) {{
        for (int k = 0; k < VEC; ++k) {{
            grad_v_carry[k] = a.grad_v_last ? a.grad_v_last[n + k] : 0.0f;
            {init_w}
        }}
    }}
    for (int t0 = (T - 1) / CHUNK * CHUNK; n < N && t0 >= 0; t0 -= CHUNK) {{
        const long long base = t0 * N + n;  // element (t0, n); step j of the chunk is base + j*N
        // State at the chunk's start (V[t0-1], W[t0-1]): the forward's checkpoint, or V[-1].
        float v_start[VEC], w_start[VEC];
        const long long c = (t0 / CHUNK - 1) * N + n;
        for (int k = 0; k < VEC; ++k) {{
            v_start[k] = t0 ? a.v_ckpt[c + k] : (a.v0 ? a.v0[n + k] : a.v_init);
            {w_start}
        }}
        pack_t xp[CHUNK], gsp[CHUNK];  // the chunk's loads first: independent, so they overlap
        #pragma unroll
        for (int j = 0; j < CHUNK; ++j) {{
            if (t0 + j >= T) break;
            xp[j] = load_pack(a.x_seq, base + j * N);
            gsp[j] = load_pack(a.grad_spike_seq, base + j * N);
        }}
        // Recompute the chunk as forward did: H[t] (and W[t]) into registers.
        float hc[CHUNK][VEC], wc[CHUNK][VEC];
        #pragma unroll
        for (int k = 0; k < VEC; ++k) {{
            float v = v_start[k], w = w_start[k];
            #pragma unroll
            for (int j = 0; j < CHUNK; ++j) {{
                if (t0 + j >= T) break;
                hc[j][k] = step(v, w, {self._input("xp[j].e[k]")}, p);
                wc[j][k] = w;
            }}
        }}
        // Walk the chunk backwards (seed 003):
        //   dL/dH[t] = dL/dS[t] Θ' + dL/dV[t] dV[t]/dH[t] (+ dL/dW[t] (∂Z[t]/∂H[t] + jump Θ'))
        #pragma unroll
        for (int j = CHUNK - 1; j >= 0; --j) {{
            if (t0 + j >= T) continue;
            pack_t gxp, gvp;
            if (a.grad_v_seq) gvp = load_pack(a.grad_v_seq, base + j * N);
            #pragma unroll
            for (int k = 0; k < VEC; ++k) {{
                const float h = hc[j][k]{load_x};
                const float v_prev = j ? reset(hc[j ? j - 1 : 0][k], p) : v_start[k];
                const float w_prev = j ? wc[j ? j - 1 : 0][k] : w_start[k];
                const float spike = h >= p.v_threshold ? 1.0f : 0.0f;
                const float sg = surrogate_grad(h - p.v_threshold);
                const float grad_v = grad_v_carry[k] + (a.grad_v_seq ? to_float(gvp.e[k]) : 0.0f);
                float grad_h = to_float(gsp[j].e[k]) * sg + grad_v * ({dv_dh});{adaptive_grad}
{store_grad}
                grad_v_carry[k] = grad_h * dh_dv(v_prev, x, w_prev, h, p);  // to V[t-1]{learn_acc}
            }}
            {"if (a.grad_x_seq) " if self.affine else ""}store_pack(a.grad_x_seq, base + j * N, gxp);
        }}
    }}
    if (n < N) {{
        for (int k = 0; k < VEC; ++k) {{
            if (a.grad_v0) a.grad_v0[n + k] = grad_v_carry[k];
            {w0_grad}{sums}
        }}
    }}{reduce}
}}
"""
        return self.header() + body

    @property
    def full_codes(self) -> str:
        """Both kernels, as one printable CUDA translation unit."""
        fptt = self.fptt_source()
        return fptt + self.bptt_source()[len(self.header()) :]


class DefinitionKernel(NeuronKernel):
    """Kernels whose snippets are printed from a program's sympy equations and partials."""

    def __init__(
        self, program: NeuronProgram, dtype: torch.dtype, vec: int = 1, affine: bool = False
    ) -> None:
        d = program.definition
        super().__init__(
            name=d.name,
            params=d.params,
            learnable=program.learnable,
            surrogate=program.surrogate,
            hard_reset=program.hard_reset,
            detach_reset=program.detach_reset,
            dtype=dtype,
            vec=vec,
            adaptive=d.adaptive,
            affine=affine,
        )
        self.definition = d
        self._names = {d.symbols[n]: f"p.{n}" for n in d.all_params}

    def _c(self, expr: sp.Expr, fast: bool = True) -> str:
        """Derivatives (backward only) print with fast division and exp; the forward's
        equations print exactly, so that H matches PyTorch bit for bit."""
        return cuda_expr(expr, self._names, fast)

    def charge(self) -> str:
        return self._c(self.definition.charge_expr, fast=False)

    def dh_dx(self) -> str:
        return self._c(self.definition.partials.dh_dx)

    def dh_dv(self) -> str:
        return self._c(self.definition.partials.dh_dv)

    def dh_dparam(self, name: str) -> str:
        return self._c(self.definition.partials.dh_dparam[name])

    def dh_dw(self) -> str:
        return self._c(self.definition.partials.dh_dw)

    def adaptation(self) -> str:
        return self._c(self.definition.adaptation_expr, fast=False)

    def adaptation_jump(self) -> str:
        return self._c(self.definition.jump_expr, fast=False)

    def dz_dh(self) -> str:
        return self._c(self.definition.partials.dz_dh)

    def dz_dw(self) -> str:
        return self._c(self.definition.partials.dz_dw)
