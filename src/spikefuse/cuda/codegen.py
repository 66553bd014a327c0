"""CUDA source generation: forward-through-time and BPTT kernels for one neuron program.

The loops live in a checked-in template, ``neuron_kernels.cuh`` (next to this file; read it
first). This module generates only what varies: a prelude with the storage type, the variant's
constants, its ``Args`` struct and the neuron's device functions printed from sympy, then the
template text behind a ``#line`` directive, so that compiler messages point into the template.

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
1/std, gamma and beta), and backward writes either the sums over t (per neuron, or per block
and channel where channels are innermost) of dL/dX and dL/dX * (Y - mean[c]) that BatchNorm's
backward reduces per channel (pass 1), or dL/dY, with
BatchNorm's coefficients computed per thread from those channel totals (pass 2).

Pooled variants (``pool`` = k > 1, channel-affine, channels-last maps) fold the k x k average
pooling that follows a fused block into its kernels: a thread owns one element of the pooled map
and the k x k neurons of its window (one channel). Forward advances the window's neurons
together and writes only their mean; backward walks them one after another (one neuron's
registers at a time), each receiving dL/d(mean) / k² as its dL/dS, and writes dL/dY (pass 2) or
the window's sums (pass 1). Only k = 2 is generated (:data:`~.kernel_spec.POOLS`): there the
mean of the spikes is exact in every dtype.

Both kernels take one argument, an ``Args`` struct whose fields are the variant's own (see
:data:`~.kernel_spec.ARG_POINTERS` and :meth:`NeuronKernel.pack_args`), so a launch packs a
single buffer.
Extension path (as in SpikingJelly's kernel templates): subclass :class:`NeuronKernel` and
return CUDA expressions from :meth:`~NeuronKernel.charge`, :meth:`~NeuronKernel.dh_dx` and
:meth:`~NeuronKernel.dh_dv` (and the two-state snippets for adaptive neurons). Expressions may use
``v`` (V[t-1]), ``x`` (X[t]), ``w`` (W[t-1]), ``h`` (H[t], derivatives only) and ``p.<param>``.
:class:`~.definition_kernel.DefinitionKernel` prints every function from a
:class:`~spikefuse.program.NeuronProgram`. Launch constants, storage types and the ``Args``
pointer fields live in :mod:`.kernel_spec`.
"""

from __future__ import annotations

import functools
import struct

import torch

from ..surrogate import Surrogate, x_sym
from .kernel_spec import (
    AFFINE_CHUNK,
    ARG_POINTERS,
    BLOCK_THREADS,
    CHUNK,
    KEEPS_INPUT_GRAD,
    LOAD_STEPS,
    POOLS,
    RESERVED_NAMES,
    STORAGE,
    TEMPLATE_NAME,
    template_source,
)
from .printer import EXACT_DIV, FAST_MATH, cuda_body

# Parameters of the per-neuron device functions: before the step, and with its H.
_STATE = "const float v, const float x, const float w, const Params& p"
_WITH_H = "const float v, const float x, const float w, const float h, const Params& p"
# acc[i] += grad_h * dH/dp_i for the learnable parameters
_ADD_LEARNABLE_GRADS = """\
add_learnable_grads(float* acc, const float grad_h, const float v, const float x, const float w,
                    const float h, const Params& p)"""


def _device_function(declaration: str, body: list[str], returns: str = "float") -> str:
    statements = "\n".join(f"    {line}" for line in body)
    return f"__device__ __forceinline__ {returns}\n{declaration}\n{{\n{statements}\n}}"


def _check_variant(
    *,
    name: str,
    params: tuple[str, ...],
    dtype: torch.dtype,
    vec: int,
    adaptive: bool,
    affine: bool,
    pool: int,
    residual: bool,
) -> None:
    """Raise ValueError for a kernel variant the template does not generate."""
    if dtype not in STORAGE:
        raise ValueError(f"unsupported storage dtype {dtype}")
    if affine and adaptive:
        raise ValueError(f"{name}: channel-affine kernels are for one-state neurons")
    if pool not in POOLS or (pool > 1 and (not affine or vec != 1)):
        raise ValueError(
            f"{name}: pooled kernels take pool in {POOLS[1:]}, affine, vec 1; got "
            f"pool={pool}, affine={affine}, vec={vec}"
        )
    if residual and (not affine or pool > 1):
        raise ValueError(f"{name}: residual kernels are unpooled affine kernels")
    clash = set(params) & RESERVED_NAMES
    if clash:
        raise ValueError(f"{name}: parameter names {sorted(clash)} are reserved by the kernels")


class NeuronKernel:
    """Template of a neuron's fused FPTT and BPTT kernels; subclasses supply the neuron snippets.

    Args:
        name: kernel name prefix (identifier).
        params: names of the float parameters (``p.<name>`` in snippets), besides the built-ins
            ``v_threshold`` and ``v_reset``, in argument order.
        learnable: those of ``params`` read from a device array (gradients are computed for them).
        surrogate: the spike's surrogate; its derivative is printed as ``surrogate_grad``.
        hard_reset, detach_reset: reset rule.
        dtype: storage dtype (float32, float16 or bfloat16).
        vec: neurons per thread (vector width of loads and stores).
        adaptive: two-state neuron (W); then the adaptation snippets must be given too.
        affine: fold a per-channel affine map into the kernels (BatchNorm; one-state neurons):
            forward reads Y and feeds X = Y * scale[c] + shift[c] to the neuron; backward
            recomputes X the same way and writes dL/dY (an affine map of dL/dX per channel)
            and/or the per-neuron sums over t that BatchNorm's backward reduces per channel.
        pool: k of the k x k average pooling folded into affine kernels (one of
            :data:`~.kernel_spec.POOLS`; 1: none): forward writes the windows' means of the
            spikes [T, N / k²], backward reads their gradient; channels-last maps, one output
            element per thread (vec 1).
        residual: unpooled affine kernels that add R (``residual_seq``, laid out like Y) to
            the neuron's input, X = Y * scale[c] + shift[c] + R, and whose pass 2 also writes
            dL/dR = dL/dX (``grad_residual_seq``): a residual block's shortcut.
        chunk: steps per backward chunk, at most :data:`~.kernel_spec.CHUNK`
            (``AFFINE_CHUNK[dtype]`` for affine kernels), which it defaults to; the launchers
            take :func:`~.kernel_spec.chunk_steps` of T. Forward saves V at every chunk's end
            but the last.
        wide_index: index elements (and pack Args' sizes) in 64-bit integers; the launchers
            ask for it where a call's indices may pass 32 bits
            (:func:`~.kernel_spec.needs_wide_index`). Built with 64-bit indices, the
            BN-folded LIF kernels had 1.4-1.6x the SASS instructions of 32-bit ones (nvcc,
            sm_90), and the bf16 forward took 1.2x the time on an H200.
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
        pool: int = 1,
        residual: bool = False,
        chunk: int | None = None,
        wide_index: bool = False,
    ) -> None:
        _check_variant(
            name=name,
            params=params,
            dtype=dtype,
            vec=vec,
            adaptive=adaptive,
            affine=affine,
            pool=pool,
            residual=residual,
        )
        self.name, self.params, self.learnable = name, params, learnable
        self.surrogate, self.hard_reset, self.detach_reset = surrogate, hard_reset, detach_reset
        self.dtype, self.vec, self.adaptive, self.affine = dtype, vec, adaptive, affine
        self.pool, self.residual, self.wide_index = pool, residual, wide_index
        # affine pass 1 may also write dL/dX (grad_input_seq) for an element-wise pass 2
        self.keeps_input_grad = affine and dtype in KEEPS_INPUT_GRAD
        longest = AFFINE_CHUNK[dtype] if affine else CHUNK
        if chunk is not None and not 1 <= chunk <= longest:
            raise ValueError(f"{name}: chunk must be in 1..{longest}, got {chunk}")
        self.chunk = longest if chunk is None else chunk
        tag = f"{'hard' if hard_reset else 'soft'}{'_detach' if detach_reset else ''}"
        tag += "_affine" if affine else ""
        tag += f"_pool{pool}" if pool > 1 else ""
        tag += "_residual" if residual else ""
        self.kernel_prefix = f"{name}_{tag}_{STORAGE[dtype].ctype.strip('_')}_v{vec}"
        self.kernel_prefix += "_i64" if wide_index else ""
        self.constant_names = tuple(
            n for n in ("v_threshold", "v_reset", *params) if n not in learnable
        )
        kinds = {"both", "affine"} if affine else {"both", "plain"}
        if adaptive:
            kinds.add("two_state")
        if residual:
            kinds.add("residual")
        self.pointers = tuple(f for f in ARG_POINTERS if f.kernels in kinds)
        self._pointer_names = tuple(f.name for f in self.pointers)
        self._null_pointers = (0,) * len(self._pointer_names)
        self.arg_layout = self._arg_struct()

    def _arg_struct(self) -> struct.Struct:
        """Args as bytes: pointers, then index_t integers, then floats; padded to 8 bytes."""
        affine, pool = self.affine, self.pool
        n_ints = (5 if affine else 2) + (affine and pool == 1) + (pool > 1)
        n_floats = 1 + self.adaptive + affine + len(self.constant_names)
        int_code, int_bytes = ("q", 8) if self.wide_index else ("i", 4)
        padding = -(n_ints * int_bytes + n_floats * 4) % 8
        return struct.Struct(f"<{len(self.pointers)}Q{n_ints}{int_code}{n_floats}f{padding}x")

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

    def body(self, function: str) -> list[str]:
        """The statements of device function ``function`` (``charge``, ``dh_dx``, ...,
        ``dh_d<param>``): ``return <snippet>;``. Subclasses may print longer bodies."""
        if function.startswith("dh_d") and function[4:] in self.learnable:
            return [f"return {self.dh_dparam(function[4:])};"]
        snippet: str = getattr(self, function)()
        return [f"return {snippet};"]

    # ---- assembly ------------------------------------------------------------------------------
    @property
    def fptt_name(self) -> str:
        return f"{self.kernel_prefix}_fptt"

    @property
    def bptt_name(self) -> str:
        return f"{self.kernel_prefix}_bptt"

    def pack_args(
        self,
        pointers: dict[str, int],
        T: int,
        N: int,
        v_init: float,
        w_init: float,
        constants: list[float],
        channels: tuple[int, int] = (1, 1),
        inv_count: float = 0.0,
        channel_tiles: int = 0,
        pool_width: int = 0,
        x_step: int | None = None,
    ) -> bytes:
        """The ``Args`` struct as bytes; absent pointers are null, pointers and values of fields
        this variant does not have are left out (``w_init`` of one-state neurons; ``channels``,
        ``inv_count`` of plain kernels). ``channels`` is (channels, inner) of the channel-affine
        kernels: c = (n / inner) % channels; ``inv_count`` scales ``bn_total_*`` to per-channel
        means (1 / elements per channel); ``channel_tiles`` (channels / 32, or 0) makes backward
        pass 1 reduce its sums per block and channel (see the template's ``bptt_first_neuron``);
        ``pool_width`` is the pooled kernels' W / k (outputs per row of a map); ``x_step``
        the unpooled affine kernels' elements from one step of Y to the next (None: N; 0: one
        step repeated over time, whose pass 2 writes dL/dY summed over T, [N]); pooled
        kernels always step by N."""
        ptrs = map(pointers.get, self._pointer_names, self._null_pointers)  # absent: null
        if self.affine:
            # pooled kernels: x_step N (Args has no field), pool_width; unpooled: x_step
            last = (pool_width,) if self.pool > 1 else (N if x_step is None else x_step,)
            ints = (T, N, *channels, channel_tiles, *last)
            return self.arg_layout.pack(*ptrs, *ints, v_init, inv_count, *constants)
        if self.adaptive:
            return self.arg_layout.pack(*ptrs, T, N, v_init, w_init, *constants)
        return self.arg_layout.pack(*ptrs, T, N, v_init, *constants)

    def _args_struct(self) -> list[str]:
        lines = [f"    {f.ctype} {f.name};  // {f.doc}" for f in self.pointers]
        lines.append("    index_t T, N;  // steps, neurons per step")
        if self.affine:
            lines.append(
                "    index_t channels, inner;  // channel of neuron n: n / inner % channels"
            )
            lines.append(
                "    index_t channel_tiles;  // backward pass 1: channels / 32 (tiled), or 0"
            )
        if self.affine and self.pool == 1:
            lines.append(
                "    index_t x_step;  // Y's step stride: N, or 0 (repeated; pass 2 sums over T)"
            )
        if self.pool > 1:
            lines.append("    index_t pool_width;  // W / POOL: outputs per row of a pooled map")
        start = "of every neuron" if self.affine else "where v0 is null"
        lines.append(f"    float v_init;  // V[-1] {start}")
        if self.adaptive:
            lines.append("    float w_init;  // W[-1] where w0 is null")
        if self.affine:
            lines.append("    float inv_count;  // backward: 1 / elements per channel")
        lines += [f"    float {n};" for n in self.constant_names]
        return ["struct Args {", *lines, "};"]

    def constant_derivatives(self) -> tuple[str, ...]:
        """The derivative functions (``dh_dv``, ...) whose value depends on the parameters
        only: computed once per thread into ``Params`` (see :meth:`_params`). None here;
        :class:`~.definition_kernel.DefinitionKernel` finds them in its equations."""
        return ()

    def parameter_functions(self) -> dict[str, str]:
        """Functions of the parameters only that the snippets read as ``p.<name>`` (name ->
        CUDA expression over ``p``), computed once per thread into ``Params``. None here;
        :class:`~.definition_kernel.DefinitionKernel` finds them in its equations (PLIF's
        sigmoid)."""
        return {}

    def _params(self) -> list[str]:
        """Params, its constant derivatives' functions, load_params, exact_div and the fast
        math (sections of the prelude)."""
        names = ("v_threshold", "v_reset", *self.params)
        loads = [
            f"p.{n} = a.learnable[{self.learnable.index(n)}];"
            if n in self.learnable
            else f"p.{n} = a.{n};"
            for n in names
        ]
        of_params = self.parameter_functions()
        divisors = (*self.params, *of_params)  # what a snippet may divide by (see EXACT_DIV)
        loads += [f"p.rcp_{n} = __frcp_rn(p.{n});" for n in self.params]
        for n, value in of_params.items():  # after the reciprocals: a value may exact_div
            loads += [f"p.{n} = {value};", f"p.rcp_{n} = __frcp_rn(p.{n});"]
        fields = [f"    float {n};" for n in names]
        fields += [f"    float {n};  // {value}" for n, value in of_params.items()]
        fields += [f"    float rcp_{n};" for n in divisors]
        constant = self.constant_derivatives()
        # Computed once per thread: the unrolled backward would compute them at every step
        # (each step's code is conditional, so the compiler cannot share one computation).
        loads += [f"p.{name} = constant_{name}(p);" for name in constant]
        fields += [
            f"    float {name};  // {name}(...), the same for every neuron" for name in constant
        ]
        declaration = [
            "// The parameters, functions of them only, the reciprocals of both (for exact_div)",
            "// and the derivatives that depend on the parameters only (unused ones vanish).",
            "struct Params {",
            *fields,
            "};",
        ]
        functions = [
            _device_function(f"constant_{name}(const Params& p)", self.body(name))
            for name in constant
        ]
        return [
            "\n".join(declaration),
            EXACT_DIV,
            FAST_MATH,
            *functions,
            _device_function(
                "load_params(const Args& a)", ["Params p;", *loads, "return p;"], returns="Params"
            ),
        ]

    def _reset_functions(self) -> list[str]:
        """reset (V[t] from H[t]) and dv_dh (dV[t]/dH[t], given the spike and Θ'): with
        detach_reset the reset's dependence on S is cut (seed 003's D_reset)."""
        if self.hard_reset:
            reset = "return h >= p.v_threshold ? p.v_reset : h;"
            dv_dh = "1.0f - spike" if self.detach_reset else "1.0f - spike + (p.v_reset - h) * sg"
        else:
            reset = "return h - (h >= p.v_threshold ? p.v_threshold : 0.0f);"
            dv_dh = "1.0f" if self.detach_reset else "1.0f - p.v_threshold * sg"
        return [
            _device_function("reset(const float h, const Params& p)", [reset]),
            _device_function(
                "dv_dh(const float h, const float spike, const float sg, const Params& p)",
                [f"return {dv_dh};"],
            ),
        ]

    def _surrogate_grad(self) -> str:
        """Θ'(x) of the surrogate (backward only: fast intrinsics, shared subexpressions)."""
        body = cuda_body(self.surrogate.derivative_expr, {x_sym: "x"}, True, True)
        return _device_function("surrogate_grad(const float x)", body)

    def derivative_functions(self) -> tuple[str, ...]:
        """The names of the partial derivatives the backward calls (all take ``_WITH_H``)."""
        names = ["dh_dx", "dh_dv"]
        if self.adaptive:
            names += ["dh_dw", "dz_dh", "dz_dw"]
        return (*names, *(f"dh_d{n}" for n in self.learnable))

    def _neuron_functions(self) -> list[str]:
        """The neuron's device functions the template calls (see its header)."""
        functions = [("charge", _STATE)]
        if self.adaptive:
            functions += [("adaptation", _WITH_H), ("adaptation_jump", "const Params& p")]
        functions += [(name, _WITH_H) for name in self.derivative_functions()]
        constant = self.constant_derivatives()
        out = [
            _device_function(
                f"{name}({params})",
                [f"return p.{name};"] if name in constant else self.body(name),
            )
            for name, params in functions
        ]
        if self.learnable:
            adds = [
                f"acc[{i}] += grad_h * dh_d{n}(v, x, w, h, p);"
                for i, n in enumerate(self.learnable)
            ]
            out.append(_device_function(_ADD_LEARNABLE_GRADS, adds, returns="void"))
        return out

    def _bptt_min_blocks(self) -> int:
        """Backward's launch bound: 2 resident blocks where registers hold more than 12 values
        of H per thread (CHUNK x VEC), else 4; 3 for residual kernels at 10 or more (R's loads
        too) and pooled kernels with learnable parameters at 12: at 64 registers PLIF's
        spilled there (nvcc for sm_90)."""
        values = self.vec * self.chunk
        if values > 12:
            return 2
        crowded = (self.residual and values >= 10) or (
            self.pool > 1 and bool(self.learnable) and values >= 12
        )
        return 3 if crowded else 4

    def _fptt_min_blocks(self) -> int:
        """Forward's launch bound: it keeps no chunk of H, so with 16-bit storage 64 registers
        hold a one-state neuron's forward without spilling (not a residual one, which loads R
        too), and the fourth resident block hides more latency; float32 forward is at memory
        bandwidth either way (backward's bound)."""
        if self.dtype in (torch.float16, torch.bfloat16) and not (self.adaptive or self.residual):
            return 4
        return self._bptt_min_blocks()

    def prelude(self) -> str:
        """What the template needs defined before it (see the template's header)."""
        storage = STORAGE[self.dtype]
        reset = "hard" if self.hard_reset else "soft"
        lines = [
            f"// spikefuse kernels {self.kernel_prefix}: neuron {self.name}, {reset} reset,",
            f"// detach_reset={self.detach_reset}, surrogate {type(self.surrogate).__name__}"
            f"({self.surrogate.extra_repr()})",
        ]
        lines += [
            *storage.declarations(),
            f"constexpr int VEC = {self.vec};  // neurons per thread",
            f"typedef {'long long' if self.wide_index else 'int'} index_t;  // element indices",
            f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
            "// Resident blocks per SM the register budget must allow (measured on an H200 and an",
            "// H100): backward 2 where registers hold more than 12 values of H per thread (CHUNK",
            "// x VEC), else 4; forward 4 with 16-bit storage (BN-folded bf16: 25% faster than 3).",
            f"constexpr int MIN_BLOCKS = {self._bptt_min_blocks()};",
            f"constexpr int FPTT_MIN_BLOCKS = {self._fptt_min_blocks()};",
            f"constexpr int CHUNK = {self.chunk};  // steps recomputed into registers by backward",
            f"constexpr int LOAD_STEPS = {LOAD_STEPS};  // steps forward loads ahead at once",
            f"constexpr bool ADAPTIVE = {str(self.adaptive).lower()};  // two-state neuron (W)",
            f"constexpr bool AFFINE = {str(self.affine).lower()};  // BatchNorm folded in",
            f"constexpr int N_LEARNABLE = {len(self.learnable)};  // parameters with gradients",
            f"constexpr int POOL = {self.pool};  // k x k windows averaged (1: no pooling)",
            f"constexpr bool RESIDUAL = {str(self.residual).lower()};  // X also adds R",
            f"constexpr bool KEEPS_INPUT_GRAD = {str(self.keeps_input_grad).lower()};"
            "  // affine pass 1 may write dL/dX",
            f"#define FPTT_KERNEL {self.fptt_name}",
            f"#define BPTT_KERNEL {self.bptt_name}",
        ]
        sections = [
            "\n".join(lines),
            "\n".join(self._args_struct()),
            *self._params(),
            *self._neuron_functions(),
            self._surrogate_grad(),
            *self._reset_functions(),
        ]
        return "\n\n".join(sections) + "\n\n"

    @functools.cached_property  # printing runs sympy (cse): once per kernel, not per access
    def full_codes(self) -> str:
        """Both kernels, as one printable CUDA translation unit: the prelude, then the template."""
        return f'{self.prelude()}#line 1 "{TEMPLATE_NAME}"\n{template_source()}'
