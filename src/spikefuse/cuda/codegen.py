"""CUDA source generation: forward-through-time and BPTT kernels for one neuron program.

One thread owns ``vec`` neighbouring neurons and walks all T steps for them; memory access is
one aligned vector load/store per tensor and step. Storage is float32, float16 or bfloat16,
arithmetic is always float32. Forward saves H[t] (rounded so that ``H >= V_th`` still gives the
forward's spike); backward walks t = T-1..0 with seed 003's dL/dH recurrence and recomputes
S[t], V[t] from H. Learnable-parameter gradients are reduced per block into a [P, blocks] buffer
(summed afterwards in a fixed order: bit-identical across runs, no float atomics).

Extension path (as in SpikingJelly's kernel templates): subclass :class:`NeuronKernel` and return
CUDA expressions from :meth:`~NeuronKernel.charge`, :meth:`~NeuronKernel.dh_dx` and
:meth:`~NeuronKernel.dh_dv` (and the two-state snippets for adaptive neurons). Expressions may use
``v`` (V[t-1]), ``x`` (X[t]), ``w`` (W[t-1]), ``h`` (H[t], derivatives only) and ``p.<param>``.
:class:`DefinitionKernel` fills every snippet from a :class:`~spikefuse.program.NeuronProgram`.
"""

from __future__ import annotations

import sympy as sp
import torch

from ..program import NeuronProgram
from ..surrogate import Surrogate
from .printer import cuda_expr

BLOCK_THREADS = 256

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
_BITS = {torch.float16: "half", torch.bfloat16: "bfloat16"}


def _storage_helpers(dtype: torch.dtype) -> str:
    ctype, include, to_f, from_f = _STORAGE[dtype]
    code = f"""\
{include}
typedef {ctype} scalar_t;
__device__ __forceinline__ float to_float(const scalar_t x) {{ return {to_f}; }}
__device__ __forceinline__ scalar_t from_float(const float x) {{ return {from_f}; }}
"""
    if dtype == torch.float32:
        return code
    bits = _BITS[dtype]
    return (
        code
        + f"""\
// Round-to-storage keeps H on the float32 value's side of boundary b (above, on, or below: so
// both `>=` and `>` tests agree): if rounding crossed or landed on it, step one ulp towards h
// (the neighbour lies beyond the exact value, hence on its side).
__device__ __forceinline__ scalar_t keep_side(scalar_t r, const float h, const float b) {{
    const float rf = to_float(r);
    if ((h > b) != (rf > b) || (h < b) != (rf < b)) {{
        const bool up = rf < h;
        unsigned short u = __{bits}_as_ushort(r);
        if ((u & 0x7fff) == 0) u = up ? 0x0001 : 0x8001;  // +-0: the smallest magnitude
        else u = (up != ((u & 0x8000) != 0)) ? u + 1 : u - 1;
        r = __ushort_as_{bits}(u);
    }}
    return r;
}}
"""
    )


def _store_h(dtype: torch.dtype, surrogate: Surrogate) -> str:
    """store_h(): H in the storage dtype such that backward recomputes the forward's spike and
    the same surrogate branch (threshold and surrogate discontinuities are kept on their side)."""
    if dtype == torch.float32:
        return (
            "__device__ __forceinline__ scalar_t store_h(const float h, const Params& p) "
            "{ return h; }  // exact"
        )
    sides = "\n".join(
        f"    r = keep_side(r, h, p.v_threshold + ({b!r}f));  // surrogate discontinuity"
        for b in surrogate.discontinuities
    )
    return f"""\
__device__ __forceinline__ scalar_t store_h(const float h, const Params& p) {{
    scalar_t r = keep_side(from_float(h), h, p.v_threshold);
{sides}
    return r;
}}"""


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
        needs_x, needs_w: whether backward snippets read X[t] / W[t-1] (kept from forward).
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
        needs_x: bool = False,
        needs_w: bool = False,
    ) -> None:
        if dtype not in _STORAGE:
            raise ValueError(f"unsupported storage dtype {dtype}")
        self.name, self.params, self.learnable = name, params, learnable
        self.surrogate, self.hard_reset, self.detach_reset = surrogate, hard_reset, detach_reset
        self.dtype, self.vec, self.adaptive = dtype, vec, adaptive
        self.needs_x, self.needs_w = needs_x, needs_w
        tag = f"{'hard' if hard_reset else 'soft'}{'_detach' if detach_reset else ''}"
        self.kernel_prefix = f"{name}_{tag}_{_STORAGE[dtype][0].strip('_')}_v{vec}"

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
        """Z[t] from h and w (two-state neurons)."""
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

    def _device_functions(self) -> str:
        fields = " ".join(f"float {n};" for n in ("v_threshold", "v_reset", *self.params))
        sig4 = "const float v, const float x, const float w, const float h, const Params& p"
        funcs = [
            f"struct Params {{ {fields} }};",
            f"__device__ __forceinline__ float charge(const float v, const float x, const float w,"
            f" const Params& p) {{ return {self.charge()}; }}",
            f"__device__ __forceinline__ float dh_dx({sig4}) {{ return {self.dh_dx()}; }}",
            f"__device__ __forceinline__ float dh_dv({sig4}) {{ return {self.dh_dv()}; }}",
            f"__device__ __forceinline__ float surrogate_grad(const float x) {{"
            f" return {self.surrogate.cuda_code('x')}; }}",
        ]
        funcs += [
            f"__device__ __forceinline__ float dh_d{n}({sig4}) {{ return {self.dh_dparam(n)}; }}"
            for n in self.learnable
        ]
        if self.adaptive:
            funcs += [
                f"__device__ __forceinline__ float dh_dw({sig4}) {{ return {self.dh_dw()}; }}",
                f"__device__ __forceinline__ float adaptation({sig4}) {{ return {self.adaptation()}; }}",
                f"__device__ __forceinline__ float adaptation_jump(const Params& p) {{"
                f" return {self.adaptation_jump()}; }}",
                f"__device__ __forceinline__ float dz_dh({sig4}) {{ return {self.dz_dh()}; }}",
                f"__device__ __forceinline__ float dz_dw({sig4}) {{ return {self.dz_dw()}; }}",
            ]
        return "\n".join(funcs)

    def _param_args(self) -> str:
        consts = [n for n in ("v_threshold", "v_reset", *self.params) if n not in self.learnable]
        return ", ".join(
            ["const float* __restrict__ learnable", *(f"const float {n}" for n in consts)]
        )

    def _load_params(self) -> str:
        lines = ["Params p;"]
        for n in ("v_threshold", "v_reset", *self.params):
            src = f"learnable[{self.learnable.index(n)}]" if n in self.learnable else n
            lines.append(f"p.{n} = {src};")
        return " ".join(lines)

    def _reset(self, h: str, spike: str) -> str:
        if self.hard_reset:
            return f"({spike} ? p.v_reset : {h})"
        return f"({h} - ({spike} ? p.v_threshold : 0.0f))"

    def header(self) -> str:
        """Shared preamble: storage helpers, vector pack and the neuron's device functions."""
        return "\n".join(
            [
                f"// spikefuse kernels: {self.name}, surrogate {type(self.surrogate).__name__}"
                f"({self.surrogate.extra_repr()}), "
                f"{'hard' if self.hard_reset else 'soft'} reset, detach_reset={self.detach_reset}",
                _storage_helpers(self.dtype),
                f"constexpr int VEC = {self.vec};  // neurons per thread",
                "struct alignas(sizeof(scalar_t) * VEC) pack_t { scalar_t e[VEC]; };",
                "__device__ __forceinline__ pack_t load_pack(const scalar_t* p, long long i) "
                "{ return *reinterpret_cast<const pack_t*>(p + i); }",
                "__device__ __forceinline__ void store_pack(scalar_t* p, long long i, const pack_t& v)"
                " { *reinterpret_cast<pack_t*>(p + i) = v; }",
                self._device_functions(),
                _store_h(self.dtype, self.surrogate),
            ]
        )

    def fptt_source(self) -> str:
        """The forward kernel: S[t], H[t] (if saving), V[t] (if storing), last V (and W)."""
        w_args = (
            "const float* __restrict__ w0, float* __restrict__ w_last, "
            "scalar_t* __restrict__ w_seq, "
            if self.adaptive
            else ""
        )
        adapt = (
            """
                const float z = adaptation(v, x, w, h, p);
                w = z + adaptation_jump(p) * (spike ? 1.0f : 0.0f);
                w_reg[k] = w;
                wp.e[k] = from_float(w);"""
            if self.adaptive
            else ""
        )
        w_init = (
            "float w_reg[VEC]; for (int k = 0; k < VEC; ++k) w_reg[k] = w0[n + k];"
            if self.adaptive
            else ""
        )
        w_store = "if (w_seq) store_pack(w_seq, off, wp);" if self.adaptive else ""
        w_last = "w_last[n + k] = w_reg[k];" if self.adaptive else ""
        w_local = "float w = w_reg[k];" if self.adaptive else "const float w = 0.0f;"
        body = f"""
extern "C" __global__ void {self.fptt_name}(
    const scalar_t* __restrict__ x_seq, const float* __restrict__ v0, {w_args}
    scalar_t* __restrict__ spike_seq, scalar_t* __restrict__ h_seq, scalar_t* __restrict__ v_seq,
    float* __restrict__ v_last, {self._param_args()}, const long long T, const long long N)
{{
    // h_seq (only when saving for backward) and v_seq (store_v_seq) may be null.
    const long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (n >= N) return;
    {self._load_params()}
    float v_reg[VEC];
    for (int k = 0; k < VEC; ++k) v_reg[k] = v0[n + k];
    {w_init}
    for (long long t = 0; t < T; ++t) {{
        const long long off = t * N + n;
        const pack_t xp = load_pack(x_seq, off);
        pack_t sp, hp, vp{", wp" if self.adaptive else ""};
        #pragma unroll
        for (int k = 0; k < VEC; ++k) {{
            const float x = to_float(xp.e[k]);
            const float v = v_reg[k];
            {w_local}
            const float h = charge(v, x, w, p);
            const bool spike = h >= p.v_threshold;{adapt}
            sp.e[k] = from_float(spike ? 1.0f : 0.0f);
            hp.e[k] = store_h(h, p);
            v_reg[k] = {self._reset("h", "spike")};
            vp.e[k] = from_float(v_reg[k]);
        }}
        store_pack(spike_seq, off, sp);
        if (h_seq) store_pack(h_seq, off, hp);
        if (v_seq) store_pack(v_seq, off, vp);
        {w_store}
    }}
    for (int k = 0; k < VEC; ++k) {{ v_last[n + k] = v_reg[k]; {w_last} }}
}}
"""
        return self.header() + body

    def bptt_source(self) -> str:
        """The backward kernel: dL/dX[t], dL/dV[0] (dL/dW[0]), per-block learnable gradients."""
        n_learn = len(self.learnable)
        # dV[t]/dH[t]; with detach_reset the reset's dependence on S is cut (seed 003's D_reset).
        if self.hard_reset:
            dv_dh = "1.0f - spike" if self.detach_reset else "1.0f - spike + (p.v_reset - h) * sg"
        else:
            dv_dh = "1.0f" if self.detach_reset else "1.0f - p.v_threshold * sg"
        x_arg = "const scalar_t* __restrict__ x_seq, " if self.needs_x else ""
        w_args = (
            "const float* __restrict__ w0, const float* __restrict__ grad_w_last, "
            "const scalar_t* __restrict__ w_seq, float* __restrict__ grad_w0, "
            if self.adaptive
            else ""
        )

        def x_at(t: str, k: str = "k") -> str:
            return f"to_float(x_seq[({t}) * N + n + {k}])" if self.needs_x else "0.0f"

        def w_at(t: str, k: str = "k") -> str:  # W[t], t = -1 is the initial state
            if not (self.adaptive and self.needs_w):
                return "0.0f"
            return f"(({t}) >= 0 ? to_float(w_seq[({t}) * N + n + {k}]) : w0[n + {k}])"

        learn_acc = "\n".join(
            f"            acc[{i}] += grad_h * dh_d{name}(v_prev, x, w_prev, h, p);"
            for i, name in enumerate(self.learnable)
        )
        adaptive_grad = ""
        if self.adaptive:
            adaptive_grad = f"""
            float grad_w = (t == T - 1 && grad_w_last) ? grad_w_last[n + k] : 0.0f;
            if (t < T - 1) {{
                const float hn = h_next[k], xn = {x_at("t + 1")}, wt = {w_at("t")};
                grad_w += grad_h_next[k] * dh_dw(v, xn, wt, hn, p)
                        + grad_w_next[k] * dz_dw(v, xn, wt, hn, p);
            }}
            grad_h += grad_w * (dz_dh(v_prev, x, w_prev, h, p) + adaptation_jump(p) * sg);
            grad_w_next[k] = grad_w;"""
        w0_grad = (
            """
        grad_w0[n + k] = grad_h_next[k] * dh_dw(v0[n + k], x, w, h, p)
                       + grad_w_next[k] * dz_dw(v0[n + k], x, w, h, p);"""
            if self.adaptive
            else ""
        )
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
    if (threadIdx.x < {n_learn}) {{
        float s = 0.0f;
        for (int i = 0; i < blockDim.x / 32; ++i) s += partial[threadIdx.x][i];
        grad_learnable_partial[(long long)threadIdx.x * gridDim.x + blockIdx.x] = s;
    }}"""
        body = f"""
extern "C" __global__ void {self.bptt_name}(
    const scalar_t* __restrict__ grad_spike_seq, const scalar_t* __restrict__ grad_v_seq,
    const float* __restrict__ grad_v_last, const scalar_t* __restrict__ h_seq, {x_arg}
    const float* __restrict__ v0, {w_args}scalar_t* __restrict__ grad_x_seq,
    float* __restrict__ grad_v0, float* __restrict__ grad_learnable_partial,
    {self._param_args()}, const long long T, const long long N)
{{
    // grad_v_seq and grad_v_last may be null (no gradient flows into them).
    const long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const bool active = n < N;  // inactive threads still join the block reduction
    {self._load_params()}
    {f"float acc[{n_learn}] = {{0.0f}};" if n_learn else ""}
    float grad_h_next[VEC], h_next[VEC]{", grad_w_next[VEC]" if self.adaptive else ""};
    pack_t hp_cur;
    if (active) hp_cur = load_pack(h_seq, (T - 1) * N + n);
    for (long long t = T - 1; active && t >= 0; --t) {{
        const long long off = t * N + n;
        pack_t hp_prev;
        if (t > 0) hp_prev = load_pack(h_seq, off - N);
        const pack_t gsp = load_pack(grad_spike_seq, off);
        pack_t gvp;
        if (grad_v_seq) gvp = load_pack(grad_v_seq, off);
        pack_t gxp;
        #pragma unroll
        for (int k = 0; k < VEC; ++k) {{
            const float h = to_float(hp_cur.e[k]);
            float v_prev;
            if (t > 0) {{
                const float hp = to_float(hp_prev.e[k]);
                v_prev = {self._reset("hp", "(hp >= p.v_threshold)")};
            }} else {{
                v_prev = v0[n + k];
            }}
            const float x = {x_at("t")}, w_prev = {w_at("t - 1")};
            const float spike = h >= p.v_threshold ? 1.0f : 0.0f;
            const float sg = surrogate_grad(h - p.v_threshold);
            const float v = {self._reset("h", "spike > 0.0f")};
            float grad_v = grad_v_seq ? to_float(gvp.e[k]) : 0.0f;
            if (t == T - 1 && grad_v_last) grad_v += grad_v_last[n + k];
            if (t < T - 1) grad_v += grad_h_next[k] * dh_dv(v, {x_at("t + 1")}, {w_at("t")}, h_next[k], p);
            float grad_h = to_float(gsp.e[k]) * sg + grad_v * ({dv_dh});{adaptive_grad}
            gxp.e[k] = from_float(grad_h * dh_dx(v_prev, x, w_prev, h, p));
{learn_acc}
            grad_h_next[k] = grad_h;
            h_next[k] = h;
        }}
        store_pack(grad_x_seq, off, gxp);
        hp_cur = hp_prev;
    }}
    if (active) {{
        for (int k = 0; k < VEC; ++k) {{
            const float x = {x_at("0")}, w = {w_at("-1")}, h = h_next[k];
            grad_v0[n + k] = grad_h_next[k] * dh_dv(v0[n + k], x, w, h, p);{w0_grad}
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

    def __init__(self, program: NeuronProgram, dtype: torch.dtype, vec: int = 1) -> None:
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
            needs_x=d.partials.needs_x,
            needs_w=d.partials.needs_w,
        )
        self.definition = d
        self._names = {d.symbols[n]: f"p.{n}" for n in d.all_params}

    def _c(self, expr: sp.Expr) -> str:
        return cuda_expr(expr, self._names)

    def charge(self) -> str:
        return self._c(self.definition.charge_expr)

    def dh_dx(self) -> str:
        return self._c(self.definition.partials.dh_dx)

    def dh_dv(self) -> str:
        return self._c(self.definition.partials.dh_dv)

    def dh_dparam(self, name: str) -> str:
        return self._c(self.definition.partials.dh_dparam[name])

    def dh_dw(self) -> str:
        return self._c(self.definition.partials.dh_dw)

    def adaptation(self) -> str:
        return self._c(self.definition.adaptation_expr)

    def adaptation_jump(self) -> str:
        return self._c(self.definition.jump_expr)

    def dz_dh(self) -> str:
        return self._c(self.definition.partials.dz_dh)

    def dz_dw(self) -> str:
        return self._c(self.definition.partials.dz_dw)


def vector_width(dtype: torch.dtype) -> int:
    """Neurons per thread for 16-byte vector access."""
    return 16 // torch.empty(0, dtype=dtype).element_size()
