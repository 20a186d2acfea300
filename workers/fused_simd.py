"""numba building blocks of the fused CPU kernels: element formats and vectors of float32 lanes.

**Element formats.** The kernels read 16-bit keys and values as their bits
(``workers.fused._flat``): bfloat16 as uint16, float16 as int16, so
that the element type names the format. :func:`widen` turns one element into
float32 in-register (bfloat16: the bits shifted up 16; float16: ``fpext``, one
F16C instruction); :func:`narrow` says at compile time whether an array holds
16-bit elements.

**Vectors.** numba's auto-vectoriser turns a loop over an array into SIMD
code but keeps an accumulator that lives in an array (a row of scores, of
``acc``) in memory, loading and storing it around every multiply-add. The
micro-kernels of ``workers.fused_micro`` and ``workers.fused_dots`` instead hold
a tile of accumulators in registers across a whole reduction, with the one type
that needs: ``f32xN``, an LLVM ``<N x float>``, in two widths:

* :data:`f32x8`, eight lanes (one AVX2 register; LLVM legalises it elsewhere);
* :data:`f32xw`, :data:`WIDE` lanes: 16 (one AVX-512 register) where the target
  numba compiles for has AVX-512F, else 8 (:func:`wide_lanes`). It is the same
  arithmetic on twice the lanes, so a kernel written on it gives bitwise the same
  lanes at either width (benchmarks/results/2026-12-07/NOTES.md, "Sixteen lanes").

and a few operations, each one LLVM instruction or intrinsic. Loads make a
vector of one width from an array, ``v*`` eight lanes and ``w*`` the wide ones;
the rest take vectors of either width:

* :func:`vload` (:func:`wload`) consecutive elements of a contiguous array from a
  flat index, widened to float32 as :func:`widen` does, all lanes at once;
* :func:`vload_pair` (:func:`wload_pair`) twice a vector's elements as two
  vectors in the array's **tile order** (:func:`split_order`): the first and the
  second half for float32 and float16, but for bfloat16 the even elements and the
  odd ones, which one load, a shift and a mask widen (two ``vload`` calls take
  two loads, two zero-extending shuffles and two shifts);
  :func:`vweave` puts a pair of even and odd elements in order;
* :func:`vsplat_at` (:func:`wsplat_at`) one element broadcast to every lane,
  :func:`vzero` (:func:`wzero`), :func:`vstore`;
* :func:`vfma` ``a * b + c`` rounded once (``llvm.fma``): a lane's result
  depends on that lane's inputs alone, so a row computes bitwise the same
  whichever rows share its tile, and whatever the vector's width;
* :func:`vmax` the larger per lane, :func:`vmax_lanes` the largest lane;
* :func:`vsum8` the lane sums of eight ``f32x8`` as one (lane ``i``: the
  sum of vector ``i``'s lanes, the same fixed tree for every lane);
* :func:`add_exact` ``a + b`` on scalars that LLVM never regroups, whatever fast-math
  the enclosing function allows: a sum built of it keeps its written order;
* :func:`prefetch` a hint to bring a cache line into L2 (``llvm.prefetch``, locality
  :data:`PREFETCH_LOCALITY`).

Flat indexes are element offsets from the array's first element; the typing
accepts C-contiguous arrays only, so that a flat index names the element it would
in a flat copy. Indexes are not checked: the kernels keep them in bounds (a
prefetch may point past the end; it never faults).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, overload, register_model


@intrinsic
def _bits_to_f32(typingctx: Any, bits: Any) -> Any:  # pragma: no cover - compiled
    """The float32 whose bits are the low 32 bits of ``bits`` (an integer: numba widens shifts to 64 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        width = getattr(bits, "bitwidth")  # noqa: B009 - numba's Integer types carry it; the stubs do not
        low = args[0] if width == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _half_to_f32(typingctx: Any, bits: Any) -> Any:  # pragma: no cover - compiled
    """float32 of the float16 whose bits are ``bits`` (int16): ``fpext``, one instruction with F16C."""
    if bits != types.int16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


def widen(x: Any) -> Any:
    """An element as float32 or float64 (numba only; see the overload)."""
    raise NotImplementedError  # pragma: no cover


@overload(widen, inline="always")
def _widen_impl(x: Any) -> Any:  # pragma: no cover - compiled
    # The element type names the format: bfloat16 arrives as uint16 bits,
    # float16 as int16 bits (workers.fused._flat).
    # (Implementations carry the stub's annotations: numba compares the signatures.)
    if x in (types.float32, types.float64):
        def same(x: Any) -> Any:
            return x
        return same
    if x == types.uint16:
        def bf16(x: Any) -> Any:
            return _bits_to_f32(np.uint32(x) << np.uint32(16))  # type: ignore[call-arg]  # numba passes typingctx
        return bf16
    if x == types.int16:
        def f16(x: Any) -> Any:
            return _half_to_f32(x)  # type: ignore[call-arg]
        return f16
    return None


def narrow(a: Any) -> Any:
    """Whether array ``a`` holds 16-bit elements, as a compile-time constant (numba only)."""
    raise NotImplementedError  # pragma: no cover


@overload(narrow)
def _narrow_impl(a: Any) -> Any:  # pragma: no cover - compiled
    is16 = a.dtype in (types.uint16, types.int16)

    def impl(a: Any) -> Any:
        return is16
    return impl


def split_order(a: Any) -> Any:
    """Whether :func:`vload_pair` (:func:`wload_pair`) gives array ``a``'s elements even/odd (bfloat16
    bits) rather than in order, as a compile-time constant (numba only)."""
    raise NotImplementedError  # pragma: no cover


@overload(split_order)
def _split_order_impl(a: Any) -> Any:  # pragma: no cover - compiled
    split = a.dtype == types.uint16

    def impl(a: Any) -> Any:
        return split
    return impl


def wide_lanes() -> int:
    """Lanes of :data:`f32xw` for the target numba compiles for: 16 with AVX-512F, else 8.

    The target's features are numba's own (``NUMBA_CPU_FEATURES`` where set, else
    the host's), the same string its disk cache keys machine code by, so a cached
    kernel was always built for the width this returns.
    """
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    chosen = getattr(config, "CPU_FEATURES", None)  # numba sets it from the environment; the stubs lack it
    features = chosen if chosen is not None else get_host_cpu_features()
    return 16 if "+avx512f" in str(features).split(",") else 8


class F32xN(types.Type):
    """numba type of ``lanes`` float32 lanes (an LLVM ``<lanes x float>``)."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        super().__init__(name=f"f32x{lanes}")


#: Lanes of :data:`f32x8`.
LANES = 8
#: Lanes of :data:`f32xw` (:func:`wide_lanes`).
WIDE = wide_lanes()
f32x8 = F32xN(LANES)
f32xw = F32xN(WIDE)
_I32 = ir.IntType(32)


@register_model(F32xN)
class _F32xNModel(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, ir.VectorType(ir.FloatType(), fe_type.lanes))


def _vector(ty: Any) -> bool:
    return isinstance(ty, F32xN)


def _llvm(ty: Any) -> Any:
    """The LLVM vector type of an ``f32xN``."""
    return ir.VectorType(ir.FloatType(), ty.lanes)


def _contiguous(a: Any) -> bool:
    return isinstance(a, types.Array) and a.layout == "C"


def _element_ptr(context: Any, builder: Any, aty: Any, arr: Any, index: Any) -> Any:
    """Pointer to element ``index`` (flat) of a C-contiguous array."""
    data = context.make_array(aty)(context, builder, value=arr).data
    return builder.gep(data, [builder.sext(index, ir.IntType(64)) if index.type.width < 64 else index])


def _loadable(a: Any, index: Any) -> bool:
    """Whether the loads read ``a`` at ``index``: a C-contiguous float32, bfloat16 or float16 array, an integer index."""
    return (_contiguous(a) and isinstance(index, types.Integer)
            and a.dtype in (types.float32, types.uint16, types.int16))


def _load(builder: Any, ptr: Any, dt: Any, n: int) -> Any:
    """``n`` elements of type ``dt`` from ``ptr``, widened to float32 lanes."""
    vec = ir.VectorType(ir.FloatType(), n)
    if dt == types.float32:
        return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), n).as_pointer()), align=2)
    if dt == types.uint16:  # bfloat16: the float32 with these bits on top
        wide = builder.zext(bits, ir.VectorType(_I32, n))
        wide = builder.shl(wide, ir.Constant(ir.VectorType(_I32, n), [16] * n))
        return builder.bitcast(wide, vec)
    half = builder.bitcast(bits, ir.VectorType(ir.HalfType(), n))  # float16
    return builder.fpext(half, vec)


def _load_pair(builder: Any, ptr: Any, dt: Any, n: int) -> tuple[Any, Any]:
    """``2 n`` elements from ``ptr`` as two ``n``-lane vectors in tile order (:func:`vload_pair`)."""
    if dt == types.uint16:
        i32s = ir.VectorType(_I32, n)
        both = builder.load(builder.bitcast(ptr, i32s.as_pointer()), align=2)  # [n] (odd << 16 | even)
        even = builder.shl(both, ir.Constant(i32s, [16] * n))
        odd = builder.and_(both, ir.Constant(i32s, [0xFFFF0000] * n))
        vec = ir.VectorType(ir.FloatType(), n)
        return builder.bitcast(even, vec), builder.bitcast(odd, vec)
    second = builder.gep(ptr, [ir.Constant(ir.IntType(64), n)])
    return _load(builder, ptr, dt, n), _load(builder, second, dt, n)


def _loads(n: int) -> tuple[Any, Any, Any, Any]:
    """The four intrinsics that make an ``n``-lane vector: load, load_pair, splat_at, zero (see the module docstring)."""
    vty = F32xN(n)
    vec = ir.VectorType(ir.FloatType(), n)
    pair = types.UniTuple(vty, 2)

    @intrinsic
    def load(typingctx: Any, a: Any, index: Any) -> Any:  # pragma: no cover - compiled
        if not _loadable(a, index):
            return None
        dt = a.dtype

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return _load(builder, _element_ptr(context, builder, signature.args[0], args[0], args[1]), dt, n)

        return vty(a, index), codegen

    @intrinsic
    def load_pair(typingctx: Any, a: Any, index: Any) -> Any:  # pragma: no cover - compiled
        if not _loadable(a, index):
            return None
        dt = a.dtype

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = _element_ptr(context, builder, signature.args[0], args[0], args[1])
            return context.make_tuple(builder, signature.return_type, _load_pair(builder, ptr, dt, n))

        return pair(a, index), codegen

    @intrinsic
    def splat_at(typingctx: Any, a: Any, index: Any) -> Any:  # pragma: no cover - compiled
        if not _contiguous(a) or a.dtype != types.float32 or not isinstance(index, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            x = builder.load(_element_ptr(context, builder, signature.args[0], args[0], args[1]))
            one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(_I32, 0))
            return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                          ir.Constant(ir.VectorType(_I32, n), [0] * n))

        return vty(a, index), codegen

    @intrinsic
    def zero(typingctx: Any) -> Any:  # pragma: no cover - compiled
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return ir.Constant(vec, [0.0] * n)

        return vty(), codegen

    load.__doc__ = f"Elements ``a[index : index + {n}]`` (flat) as float32 lanes."
    load_pair.__doc__ = (f"Elements ``a[index : index + {2 * n}]`` (flat) as float32 lanes, two vectors in tile order "
                         f"(:func:`split_order`): ``(a[i : i+{n}], a[i+{n} : i+{2 * n}])``, or for bfloat16 bits "
                         f"(uint16) ``(a[i : i+{2 * n} : 2], a[i+1 : i+{2 * n} : 2])``.\n\n"
                         "A bfloat16 is the top half of a float32, so the elements read as 32-bit lanes hold "
                         "element ``2l + 1`` on top of element ``2l``: the lane with its low half cleared is the "
                         "odd element, the lane shifted up 16 the even one (both exact).")
    splat_at.__doc__ = "Element ``a[index]`` (flat; ``a`` float32) in every lane: one broadcast load, no index checks."
    zero.__doc__ = f"{n} zeros."
    return load, load_pair, splat_at, zero


vload, vload_pair, vsplat_at, vzero = _loads(LANES)
wload, wload_pair, wsplat_at, wzero = _loads(WIDE)


@intrinsic
def vweave(typingctx: Any, even: Any, odd: Any) -> Any:  # pragma: no cover - compiled
    """The pair in order from its even and odd elements: ``(e0 o0 e1 o1 .. , .. e(n-1) o(n-1))`` (``n`` lanes each)."""
    if not (_vector(even) and even == odd):
        return None
    n = even.lanes
    half = n // 2
    masks = ([m for lane in range(half) for m in (lane, n + lane)],  # e0 o0 .. e(n/2-1) o(n/2-1)
             [m for lane in range(half, n) for m in (lane, n + lane)])

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        out = [builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(_I32, n), m)) for m in masks]
        return context.make_tuple(builder, signature.return_type, out)

    return types.UniTuple(even, 2)(even, odd), codegen


@intrinsic
def vstore(typingctx: Any, a: Any, index: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """``a[index : index + n] = x`` (flat; ``a`` float32, ``x`` of ``n`` lanes)."""
    if not _contiguous(a) or a.dtype != types.float32 or not isinstance(index, types.Integer) or not _vector(x):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_ptr(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(ptr, _llvm(x).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(a, index, x), codegen


@intrinsic
def vfma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:  # pragma: no cover - compiled
    """``a * b + c`` per lane, rounded once."""
    if not (_vector(a) and a == b == c):
        return None
    vec = _llvm(a)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fma.v{a.lanes}f32")
        return builder.call(fn, list(args))

    return a(a, b, c), codegen


@intrinsic
def vmax(typingctx: Any, a: Any, b: Any) -> Any:  # pragma: no cover - compiled
    """The larger of ``a`` and ``b`` per lane: ``a if a > b else b``, the scalar ``max``'s choice for
    every pair that is not NaN (a maximum is exact: any order of the lanes gives the same value)."""
    if not (_vector(a) and a == b):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return a(a, b), codegen


@intrinsic
def vmax_lanes(typingctx: Any, a: Any) -> Any:  # pragma: no cover - compiled
    """The largest lane of ``a`` as a float32: halves folded with :func:`vmax` down to one lane."""
    if not _vector(a):
        return None
    n = a.lanes

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x, width = args[0], n
        while width > 1:
            width //= 2
            # Lanes [width, 2 width) onto [0, width); the upper lanes become don't-cares.
            high = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, n),
                                                            [width + i if i < width else i for i in range(n)]))
            x = builder.select(builder.fcmp_ordered(">", x, high), x, high)
        return builder.extract_element(x, ir.Constant(_I32, 0))

    return types.float32(a), codegen


def _fadd_in_order(builder: Any, a: Any, b: Any) -> Any:
    """``a + b`` that no fast-math flag lets LLVM regroup.

    numba gives every ``fadd`` without flags in a ``fastmath`` function that function's flags
    (``numba.core.fastmathpass``: ``reassoc`` among them for the kernels), even one an intrinsic
    emits. One that already has a flag is left alone, so this one carries ``arcp`` (approximate
    reciprocals: nothing an add does), and no ``reassoc``.
    """
    out = builder.fadd(a, b)
    out.flags.append("arcp")
    return out


def _lane_pairs(builder: Any, a: Any, b: Any, lo: list[int], hi: list[int]) -> Any:
    """``shuffle(a, b, lo) + shuffle(a, b, hi)``: one level of :func:`vsum8`'s tree (never regrouped)."""
    pick = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, LANES), m)) for m in (lo, hi)]
    return _fadd_in_order(builder, pick[0], pick[1])


@intrinsic
def vsum8(typingctx: Any, a0: Any, a1: Any, a2: Any, a3: Any, a4: Any, a5: Any, a6: Any,
          a7: Any) -> Any:  # pragma: no cover - compiled
    """Lane ``i`` = the sum of ``a_i``'s eight lanes x0..x7, as ``((x0+x1) + (x2+x3)) + ((x4+x5) + (x6+x7))``.

    Three levels of shuffles and adds (a transpose that adds as it goes): the tree
    is the same for every input, so a lane's sum depends on its own vector alone.
    """
    if not all(a == f32x8 for a in (a0, a1, a2, a3, a4, a5, a6, a7)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        # Level 1, vectors in pairs (a, b): [a0+a1, b0+b1, a2+a3, b2+b3, a4+a5, b4+b5, a6+a7, b6+b7].
        one = [_lane_pairs(builder, args[i], args[i + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15])
               for i in range(0, LANES, 2)]
        # Level 2, pairs of those (ab, cd): [a0..3, b0..3, c0..3, d0..3, a4..7, b4..7, c4..7, d4..7].
        two = [_lane_pairs(builder, one[i], one[i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
               for i in (0, 2)]
        # Level 3: the low halves' sums plus the high halves' sums, vector i in lane i.
        return _lane_pairs(builder, two[0], two[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])

    return f32x8(a0, a1, a2, a3, a4, a5, a6, a7), codegen


@intrinsic
def add_exact(typingctx: Any, a: Any, b: Any) -> Any:  # pragma: no cover - compiled
    """``a + b`` (two float32 or two float64), never reassociated with the adds around it.

    The kernels compile with ``reassoc`` (``workers.fused_kernels.FASTMATH``), which lets LLVM
    regroup a sum as it likes; the grouping it chose for a sum of a row's probabilities was not the
    same in the process that compiled the kernel and in one that loaded it from numba's disk cache
    (a last bit of ``l``). This add cannot be regrouped (:func:`_fadd_in_order`): LLVM may still
    put independent ones side by side in a vector, which changes no result.
    """
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _fadd_in_order(builder, args[0], args[1])

    return a(a, b), codegen


#: ``llvm.prefetch`` locality of :func:`prefetch`: 2, into L2 and not L1 (``prefetcht1`` on x86). A
#: prefetch into L1 holds one of its few fill buffers until the line arrives, and decode streams
#: 8 key runs at once: into L2, resident bfloat16 decode read 3-11% more (benchmarks/results/2026-12-07/NOTES.md,
#: "Sixteen lanes"); locality 0 (non-temporal) read 40% less.
PREFETCH_LOCALITY = 2


@intrinsic
def prefetch(typingctx: Any, a: Any, index: Any) -> Any:  # pragma: no cover - compiled
    """Hint: element ``a[index]`` (flat) will be read soon, bring its line into L2; never faults,
    even past the end."""
    if not _contiguous(a) or not isinstance(index, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.bitcast(_element_ptr(context, builder, signature.args[0], args[0], args[1]),
                              ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, PREFETCH_LOCALITY), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(a, index), codegen
