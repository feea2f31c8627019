"""Triton kernels of the fused CUDA path (imported only when Triton is installed; see `triton_path`).

Kept apart because Triton's ``@triton.jit`` functions are untyped; `triton_path` holds the typed launcher.
"""

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    normal = ((tl.minimum(tl.maximum(e, -126), 127) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e < -126, 5.877471754111438e-39, normal)  # 2^-127, E8M0's smallest scale


@triton.jit
def round_half_even(s):
    # floor-based so it is exact everywhere (the interpreter has no rint): ties go to the even neighbour.
    low = tl.floor(s)
    frac = s - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    return low + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float32)


@triton.jit
def binade(a):
    return (a.to(tl.int32, bitcast=True) >> 23) - 127


@triton.jit
def cast(v, noise, EMIN: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr, SPECIAL: tl.constexpr,
         IS_INT: tl.constexpr, SATURATE: tl.constexpr, STOCHASTIC: tl.constexpr):  # fmt: skip
    # Returns (q, overflow): overflow marks finite inputs that rounded beyond ±max (see reference.cast_with_overflow).
    finite = tl.abs(v) < float("inf")
    if IS_INT:
        if STOCHASTIC:
            low = tl.floor(v)
            r = low + (noise < v - low).to(tl.float32)
        else:
            r = round_half_even(v)
        too_big = tl.abs(r) > MAXV
        # tl.minimum/maximum drop NaN; keep it like torch.clamp does.
        result = tl.where(v != v, float("nan"), tl.minimum(tl.maximum(r, -MAXV), MAXV))
    else:
        a = tl.where(finite, tl.abs(v), 0.0)
        e = tl.maximum(binade(a), EMIN)
        scaled = a * pow2(MBITS - e)
        if STOCHASTIC:
            low = tl.floor(scaled)
            r = low + (noise < scaled - low).to(tl.float32)
        else:
            r = round_half_even(scaled)
        m = r * pow2(e - MBITS)
        too_big = m > MAXV
        overflow = too_big | ~finite
        if SATURATE or SPECIAL == 0:
            m = tl.where(overflow, MAXV, m)
        elif SPECIAL == 1:
            m = tl.where(overflow, float("inf"), m)
        else:
            m = tl.where(overflow, float("nan"), m)
        signed = tl.where(v < 0, -m, m)
        signed = tl.where((v == 0) & (v.to(tl.int32, bitcast=True) < 0), -m, signed)
        result = tl.where(v != v, float("nan"), signed)
    return result, too_big & finite


@triton.jit
def partials(x, q, overflow, valid_lane, out_ptr, pid):
    finite_x = (tl.abs(x) < float("inf")) & valid_lane
    finite_q = tl.abs(q) < float("inf")
    ok = finite_x & finite_q
    xv = tl.where(ok, x, 0.0).to(tl.float64)
    qv = tl.where(ok, q, 0.0).to(tl.float64)
    err = qv - xv
    nonzero = finite_x & (x != 0)
    clipped = finite_x & (overflow | ~finite_q)
    nonfinite = valid_lane & ~finite_x
    base = out_ptr + pid * 11
    tl.store(base + 1, tl.sum(xv * xv))
    tl.store(base + 2, tl.sum(qv * qv))
    tl.store(base + 3, tl.sum(qv * xv))
    tl.store(base + 4, tl.sum(err * err))
    tl.store(base + 5, tl.max(tl.abs(err)))
    tl.store(base + 6, tl.max(tl.abs(tl.where(finite_x, x, 0.0))).to(tl.float64))
    tl.store(base + 7, tl.sum(nonzero.to(tl.float64)))
    tl.store(base + 8, tl.sum((nonzero & (q == 0)).to(tl.float64)))
    tl.store(base + 9, tl.sum(clipped.to(tl.float64)))
    tl.store(base + 10, tl.sum(nonfinite.to(tl.float64)))


@triton.jit
def flat_kernel(x_ptr, noise_ptr, q_ptr, scale_ptr, stats_ptr, n,
                EMIN: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr, SPECIAL: tl.constexpr,
                IS_INT: tl.constexpr, SATURATE: tl.constexpr, STOCHASTIC: tl.constexpr, SCALED: tl.constexpr,
                WITH_STATS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    lane = offsets < n
    x_raw = tl.load(x_ptr + offsets, mask=lane, other=0.0)
    x = x_raw.to(tl.float32)
    noise = x
    if STOCHASTIC:
        noise = tl.load(noise_ptr + offsets, mask=lane, other=0.0)
    if SCALED:
        s = tl.load(scale_ptr)
        q, overflow = cast(tl.math.div_rn(x, s), noise, EMIN, MBITS, MAXV, SPECIAL, IS_INT, SATURATE, STOCHASTIC)
        q = q * s
    else:
        q, overflow = cast(x, noise, EMIN, MBITS, MAXV, SPECIAL, IS_INT, SATURATE, STOCHASTIC)
    q_out = q.to(x_raw.dtype)
    tl.store(q_ptr + offsets, q_out, mask=lane)
    if WITH_STATS:
        partials(x, q_out.to(tl.float32), overflow, lane, stats_ptr, pid)


@triton.jit
def block_kernel(x_ptr, noise_ptr, q_ptr, scale_out_ptr, tensor_scale_ptr, stats_ptr, n_blocks,
                 BS: tl.constexpr, BS_POW2: tl.constexpr, ROWS: tl.constexpr,
                 EMIN: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr, EMAX: tl.constexpr,
                 SPECIAL: tl.constexpr, IS_INT: tl.constexpr, SATURATE: tl.constexpr,
                 STOCHASTIC: tl.constexpr, NV: tl.constexpr, WITH_STATS: tl.constexpr,
                 E4M3_MAX: tl.constexpr, NV_SCALE_MIN: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BS_POW2)
    lane = (rows[:, None] < n_blocks) & (cols[None, :] < BS)
    offsets = rows[:, None] * BS + cols[None, :]
    x_raw = tl.load(x_ptr + offsets, mask=lane, other=0.0)
    x = x_raw.to(tl.float32)
    noise = x
    if STOCHASTIC:
        noise = tl.load(noise_ptr + offsets, mask=lane, other=0.0)
    magnitude = tl.abs(x)
    block_amax = tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=1)
    if NV:
        ts = tl.load(tensor_scale_ptr)
        raw = tl.math.div_rn(tl.math.div_rn(block_amax, MAXV), ts)
        raw = tl.minimum(tl.maximum(raw, NV_SCALE_MIN), E4M3_MAX)
        block_scale, _ = cast(raw, raw, -6, 3, E4M3_MAX, 2, False, True, False)
        element_scale = ts * block_scale
    else:
        shared = tl.minimum(tl.maximum(binade(block_amax) - EMAX, -127), 127)
        block_scale = pow2(shared)
        element_scale = block_scale
    tl.store(scale_out_ptr + rows, block_scale, mask=rows < n_blocks)
    scaled = tl.math.div_rn(x, element_scale[:, None])
    q, overflow = cast(scaled, noise, EMIN, MBITS, MAXV, SPECIAL, IS_INT, SATURATE, STOCHASTIC)
    q = q * element_scale[:, None]
    q_out = q.to(x_raw.dtype)
    tl.store(q_ptr + offsets, q_out, mask=lane)
    if WITH_STATS:
        partials(x, q_out.to(tl.float32), overflow, lane, stats_ptr, pid)
