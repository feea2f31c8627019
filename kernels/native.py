"""The native CPU fast path: quantize and every error statistic in one or two hand-written passes (``native.cpp``).

Where the ``torch.compile`` path is bound by the instructions Inductor generates (~48 AVX-512 instructions per 16
elements), these kernels round with one float32 addition (see ``native.cpp``), take 24-42 per 16 elements with every
statistic, and write large outputs with streaming stores: quantize + statistics of a large float32 tensor costs
about a read pass more than writing the output at all. The source is compiled on first use with the C++ compiler
torch.compile uses as well (``$CXX``, else ``c++``) for this machine's CPU (``-march=native``, OpenMP; another target
with ``$QUANTWATCH_NATIVE_MARCH``, e.g. ``haswell`` for an AVX2 build on an AVX-512 host), cached under
``$QUANTWATCH_CACHE_DIR`` (default ``~/.cache/quantwatch``) by a hash of the source, the flags, the compiler's
version and the CPU, and loaded with ctypes. The kernels' vectors are one register of the widest unit the build
targets (16 floats with AVX-512, 8 with AVX2: `vector_isa` says which).

What it runs: contiguous float32 CPU tensors, round to nearest or stochastically (from the caller's uniform draws,
``noise``: bit for bit as the reference rounds with them), float and integer element formats (FP8, FP6, FP4,
INT8, INT4: an integer grid is a float grid whose spacing is 1 up to its maximum), scalings none, tensor, delayed,
channel when each channel's elements lie in runs of 16 or more (``channel:0`` of a weight) or are single elements of
16 or more channels (``channel:-1``), block:16/32/64 and nvblock:16 when the last dimension holds whole blocks,
saturating (or a format or scaling that cannot overflow).
Anything else — and a tensor holding NaN/±inf, or statistics outside the float32 runs' range — is declined
(`quantize_native` returns None) and the caller runs the compiled or reference backend. Quantized values are
bit-exact against the reference; statistics agree to 1e-6 (tests/kernels).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from array import array
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from .backends import QuantRequest, QuantResult, raise_if_unsupported
from .formats import FP4_E2M1, FP8_E4M3, NVFP4_BLOCK_SCALE_MIN, FormatSpec, Kind, Special
from .options import Backend, BackendUnavailableError, Rounding, Scaling, ScalingSpec
from .partial_sums import RowStats, lane_sums_in_range, pass_buffer, pass_fields
from .reference import amax_to_scale, channel_dims

log = logging.getLogger(__name__)

# The `backends.FastPath` protocol, implemented by this module (`unsupported_reason`, `available`, `prepare`,
# `quantize`).
NAME = Backend.NATIVE

SOURCE = Path(__file__).with_name("native.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# The CPU the library is built for (GCC/Clang ``-march=``): argument > $QUANTWATCH_NATIVE_MARCH > "native".
MARCH_ENV = "QUANTWATCH_NATIVE_MARCH"
DEFAULT_MARCH = "native"
_MARCH_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
# What `qw_vector_isa` in native.cpp reports: the vector unit the build's kernels use.
VECTOR_ISAS = {1: "avx2", 2: "avx512", 0: "generic"}
BLOCK_SIZES = (16, 32, 64)
NVBLOCK_SIZE = 16
# Streaming stores bypass the cache: right for outputs larger than the caches, wrong for small ones read again soon.
STREAM_MIN_BYTES = 8 << 20
# 32-bit lane counts and float32 runs hold for tensors below this many elements (one count per lane per vector).
MAX_NUMEL = 1 << 40
# The kernels divide by a scale through its reciprocal (exact for scales >= 2^-80, see divide() in native.cpp) and
# need every x / scale well inside float32; tensors whose scales fall outside are declined.
MIN_SCALE = 2.0**-80
MAX_QUOTIENT = 2.0**120
BUILD_TIMEOUT_SECONDS = 120
PARALLEL_MIN_NUMEL = 1 << 16

# The kernels' roundings (`Round` in native.cpp): an integer grid rounds stochastically on the signed value, as the
# reference does, a float grid on the magnitude.
_NEAREST, _STOCHASTIC, _STOCHASTIC_INTEGER = range(3)
# The kernels' modes (`Mode` in native.cpp).
_PLAIN, _TENSOR, _MX_BLOCK, _NV_BLOCK, _CHANNEL, _COLUMNS = range(6)
_MODES = {
    Scaling.NONE: _PLAIN,
    Scaling.TENSOR: _TENSOR,
    Scaling.DELAYED: _TENSOR,
    Scaling.BLOCK: _MX_BLOCK,
    Scaling.NVBLOCK: _NV_BLOCK,
    Scaling.CHANNEL: _CHANNEL,  # _COLUMNS where each channel's elements are single: see _channel_layout
}
_TWO_PASS = (_TENSOR, _NV_BLOCK, _CHANNEL, _COLUMNS)  # modes whose scales need a scan first
# Channel scaling runs a channel's contiguous segments one by one, each with its own scale, or (segments of one
# element) rows of channels with a vector of scales each: shorter segments, or rows of fewer channels, would spend
# more on each segment or row than on its elements, and fewer rows more on the channels' scales than on the rows.
MIN_CHANNEL_SEGMENT = 16
_STATUS_OK, _STATUS_BAD_ARGUMENT = 0, 3
_F32 = ctypes.c_float
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_PTR = ctypes.c_void_p

# The kernels' argument types (each returns an int: a status, or `qw_vector_isa`'s unit).
_CAST = [_PTR, _PTR, _I64, _INT, _INT, _INT, _F32, _INT, _I64, _F32, _PTR, _PTR, _INT, _INT, _PTR, _INT, _PTR, _INT]
_SIGNATURES = {
    "qw_scan": [_PTR, _I64, _I64, _PTR, _PTR, _INT],
    "qw_scan_columns": [_PTR, _I64, _I64, _PTR, _PTR, _INT],
    "qw_cast": _CAST,
    "qw_stats": [_PTR, _PTR, _PTR, _I64, _PTR, _INT],
    "qw_stats_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "qw_float8_stats": [_PTR, _PTR, _PTR, _PTR, _I64, _F32, _F32, _I64, _PTR, _INT],
    "qw_decode_bytes": [_PTR, _PTR, _PTR, _I64, _INT],
    "qw_vector_isa": [],
}


def threads_for(n: int) -> int:
    """The threads a call over ``n`` elements runs on: one below `PARALLEL_MIN_NUMEL` (waking the others, and on a
    busy machine waiting until each gets a core at the closing barrier, costs more than they save), else torch's."""
    return torch.get_num_threads() if n >= PARALLEL_MIN_NUMEL else 1


def plain(x: Tensor) -> bool:
    """Whether ``x`` is a plain tensor or parameter: a subclass (a wrapper such as torchao's float8 weights) may hold
    its values elsewhere than at its ``data_ptr``, so the kernels never read one."""
    return type(x) in (Tensor, nn.Parameter)


def unsupported_reason(x: Tensor, fmt: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool) -> str | None:
    """Why the native path cannot run this quantization (whatever the values), or None when it can."""
    if x.device.type != "cpu":
        return f"{x.device.type} tensors (CPU only)"
    if not plain(x):
        return f"tensor subclass {type(x).__name__} (its storage is not its values)"
    if x.dtype != torch.float32:
        return f"dtype {x.dtype} (float32 only)"
    if not x.is_contiguous():
        return "non-contiguous tensors"
    if x.numel() >= MAX_NUMEL:
        return f"tensors of {MAX_NUMEL} elements or more"
    if fmt.kind not in (Kind.FLOAT, Kind.INT):
        return f"{fmt.kind.value} element formats (float and integer formats only)"
    if spec.kind is Scaling.CHANNEL and x.numel():
        segment = _channel_segment(x, spec)
        channels = x.shape[spec.axis] if x.dim() else 1
        rows = x.numel() // channels
        if segment < MIN_CHANNEL_SEGMENT and (segment > 1 or min(channels, rows) < MIN_CHANNEL_SEGMENT):
            return (
                f"channel scaling along axis {spec.axis} of a {tuple(x.shape)} tensor: each channel's elements in runs "
                f"of {segment} among {channels} channels (runs of at least {MIN_CHANNEL_SEGMENT}, or single elements "
                f"of at least {MIN_CHANNEL_SEGMENT} channels in at least {MIN_CHANNEL_SEGMENT} rows)"
            )
    if spec.kind in (Scaling.BLOCK, Scaling.NVBLOCK):
        sizes = BLOCK_SIZES if spec.kind is Scaling.BLOCK else (NVBLOCK_SIZE,)
        if spec.block_size not in sizes:
            return f"{spec.kind.value} size {spec.block_size} (supported: {', '.join(map(str, sizes))})"
        last = x.shape[-1] if x.dim() else 1
        if last % spec.block_size:
            return f"a last dimension of {last}, not a whole number of blocks of {spec.block_size}"
    if not saturate and fmt.special is not Special.NONE and _may_clip(fmt, spec, True, rounding):
        return "non-saturating casts that can overflow"
    return None


def _channel_segment(x: Tensor, spec: ScalingSpec) -> int:
    """How many consecutive elements of contiguous ``x`` share a channel: the size of the dimensions after the axis
    (``ValueError`` for an axis out of range)."""
    if x.dim() == 0:
        return 1
    channel_dims(x.dim(), spec.axis)
    return math.prod(x.shape[spec.axis % x.dim() + 1 :])


def _channel_layout(x: Tensor, spec: ScalingSpec) -> tuple[int, int]:
    """(mode, block) of channel scaling: CHANNEL with segments of ``block`` elements, or, where each segment is one
    element (the channel axis last), COLUMNS with rows of ``block`` channels."""
    segment = _channel_segment(x, spec)
    return (_COLUMNS, x.shape[spec.axis]) if segment == 1 else (_CHANNEL, segment)


def _channel_scales(
    lib: ctypes.CDLL,
    x: Tensor,
    fmt: FormatSpec,
    spec: ScalingSpec,
    mode: int,
    block: int,
    scanned: array[float],
    threads: int,
) -> tuple[Tensor, Tensor] | None:
    """The scan of channel scaling (its statistics into ``scanned``): the channels' scales (as
    `reference.amax_to_scale` gives them) and what the cast reads — each segment's scale (CHANNEL), or the scales
    then their reciprocals, each padded with ones to whole vectors (COLUMNS) — or None to decline the tensor."""
    n = x.numel()
    channels = x.shape[spec.axis]
    if mode == _CHANNEL:
        segment_amax = torch.empty(n // block, dtype=torch.float32)
        status = lib.qw_scan(x.data_ptr(), n, block, segment_amax.data_ptr(), scanned.buffer_info()[0], threads)
        channel_amax = segment_amax.view(-1, channels).amax(0)
    else:
        padded = -(-channels // 16) * 16
        # A thread's column maxima per MIN_CHANNEL_SEGMENT rows at most: never more than n / 16 floats.
        threads = max(1, min(threads, n // channels // MIN_CHANNEL_SEGMENT))
        column_amax = torch.zeros(threads, padded, dtype=torch.float32)
        status = lib.qw_scan_columns(
            x.data_ptr(), n, channels, column_amax.data_ptr(), scanned.buffer_info()[0], threads
        )
        channel_amax = column_amax[:, :channels].amax(0)
    if status != _STATUS_OK:
        return None
    channel_scale = amax_to_scale(channel_amax, fmt)
    if float(channel_scale.min()) < MIN_SCALE:
        return None
    if mode == _CHANNEL:
        return channel_scale, channel_scale.repeat(n // (block * channels))  # one per segment, in memory order
    cast_in = torch.ones(2, padded, dtype=torch.float32)
    cast_in[0, :channels] = channel_scale
    cast_in[1, :channels] = 1 / channel_scale  # float32 division: the correctly rounded reciprocal
    return channel_scale, cast_in


def _grid(fmt: FormatSpec) -> tuple[int, int, int]:
    """(mantissa bits, emin, emax) of the kernels' rounding for ``fmt``: an integer format rounds like a float format
    whose every binade up to its maximum has spacing 1 (2^(emax − m) with m = emin = emax)."""
    if fmt.kind is Kind.INT:
        return fmt.emax, fmt.emax, fmt.emax
    return fmt.mantissa_bits, fmt.emin, fmt.emax


def _may_clip(fmt: FormatSpec, spec: ScalingSpec, given_scale: bool, rounding: Rounding) -> bool:
    # A scale taken from the amax keeps |x / scale| within the maximum up to rounding (a larger margin or a power of
    # two rounded up only shrinks it); an NVFP4 E2M1 block cannot clip either (see compiled._fused_lanes). Rounding
    # stochastically, a value within the maximum up to a rounding may round up past it: every scaling may clip.
    if rounding is Rounding.STOCHASTIC:
        return True
    if spec.kind is Scaling.CHANNEL:
        return False
    if spec.kind in (Scaling.TENSOR, Scaling.DELAYED):
        return given_scale or spec.margin < 0
    if spec.kind is Scaling.NVBLOCK:
        return fmt != FP4_E2M1
    return True


def cache_dir() -> Path:
    """Where built libraries are kept: ``$QUANTWATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantwatch``, else
    ``~/.cache/quantwatch``."""
    explicit = os.environ.get("QUANTWATCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quantwatch"


def _compiler_version(compiler: str) -> str:
    # A compiler upgraded in place must not reuse builds of the old one.
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise BackendUnavailableError("native backend needs a C++ compiler ($CXX, c++, g++ or clang++); none found")
    return compiler


def _cpu_identity() -> str:
    # -march=native builds for this CPU: a cache shared by machines of different CPUs must not mix their builds.
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    facts = sorted({line for line in lines if line.split(":")[0].strip() in wanted})
    return "\n".join([platform.machine(), platform.processor(), *facts])


def march(explicit: str | None = None) -> str:
    """The ``-march`` target of the build: ``explicit``, else ``$QUANTWATCH_NATIVE_MARCH``, else ``"native"``.

    Raises ``ValueError`` for a value that is not a plain target name (letters, digits, ``_.+-``, up to 64).
    """
    value = explicit if explicit is not None else (os.environ.get(MARCH_ENV) or DEFAULT_MARCH)
    if not _MARCH_PATTERN.fullmatch(value):
        raise ValueError(f"{MARCH_ENV}: {value!r} is not a -march target name (letters, digits, _.+-; up to 64)")
    return value


def flags(target: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build for ``target`` (see `march`)."""
    return tuple(f"-march={march(target)}" if flag.startswith("-march=") else flag for flag in FLAGS)


def build(directory: Path | None = None, target: str | None = None) -> Path:
    """Compile ``native.cpp`` for ``target`` (see `march`) into ``directory`` (default `cache_dir`) unless an
    identical build is there; its path.

    Raises `BackendUnavailableError` when no compiler is found or the build fails (with the compiler's message).
    """
    compiler = _compiler()
    build_flags = flags(target)
    digest = hashlib.sha256()
    identity = (compiler, _compiler_version(compiler), _cpu_identity())
    for part in (SOURCE.read_bytes(), " ".join(build_flags).encode(), *(text.encode() for text in identity)):
        digest.update(part)
        digest.update(b"\0")
    directory = directory or cache_dir()
    library_path = directory / f"native-{digest.hexdigest()[:20]}.so"
    if library_path.exists():
        return library_path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".native-", suffix=".so", dir=directory)
        os.close(handle)
    except OSError as error:
        raise BackendUnavailableError(f"native backend cannot write its build to {directory}: {error}") from error
    try:
        result = subprocess.run(
            [compiler, *build_flags, "-o", temporary, str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_SECONDS,
            check=False,
        )
        if result.returncode != 0:
            message = (result.stderr or result.stdout).strip()[-2000:]
            raise BackendUnavailableError(f"native backend: {compiler} failed to build {SOURCE.name}:\n{message}")
        os.chmod(temporary, 0o755 & ~_umask())  # mkstemp made it private: a shared cache serves other users too
        os.replace(temporary, library_path)  # atomic: a concurrent build of the same key writes the same bytes
    except (OSError, subprocess.SubprocessError) as error:
        raise BackendUnavailableError(f"native backend: running {compiler} failed: {error}") from error
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return library_path


def _umask() -> int:
    # Read, not set and restored: os.umask would change it for every thread of the process for a moment.
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


_LOCK = threading.Lock()
_LOADED: ctypes.CDLL | BackendUnavailableError | None = None


def _after_fork_in_child() -> None:
    # A fork while another thread builds would leave the child a held lock and no builder: start over.
    global _LOCK, _LOADED
    _LOCK = threading.Lock()
    if not isinstance(_LOADED, ctypes.CDLL):
        _LOADED = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _load() -> ctypes.CDLL | BackendUnavailableError:
    """The library, built and loaded on first call (once per process; other threads wait for it), or why not."""
    global _LOADED
    with _LOCK:
        if _LOADED is None:
            _LOADED = _build_and_load()
        return _LOADED


def _build_and_load() -> ctypes.CDLL | BackendUnavailableError:
    try:
        lib = ctypes.CDLL(str(build()))
    except (BackendUnavailableError, OSError, ValueError) as error:
        reason = error if not isinstance(error, OSError) else f"cannot load its library: {error}"
        # Once per process: `auto` then quietly runs CPU quantizations on the compiled path or the (slow) reference.
        log.warning("quantwatch.kernels: native kernels unavailable, CPU quantization falls back: %s", reason)
        return error if isinstance(error, BackendUnavailableError) else BackendUnavailableError(str(reason))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = _INT, argtypes
    return lib


def reset() -> None:
    """Forget the loaded library (or the reason it could not be had): the next use builds or loads it again."""
    global _LOADED
    with _LOCK:
        _LOADED = None


def library() -> ctypes.CDLL:
    """The loaded native library (built on first use); `BackendUnavailableError` when it cannot be had."""
    lib = _load()
    if isinstance(lib, BackendUnavailableError):
        raise lib
    return lib


def vector_isa() -> str:
    """The vector unit the loaded library's kernels use: ``"avx512"``, ``"avx2"`` or ``"generic"`` (16 floats in
    registers of another unit); builds and loads it first (`BackendUnavailableError` when it cannot be had)."""
    return VECTOR_ISAS[int(library().qw_vector_isa())]


def available() -> bool:
    """True when the native library builds and loads on this machine (building it now if it was not)."""
    return not isinstance(_load(), BackendUnavailableError)


def loaded() -> ctypes.CDLL | None:
    """The library when an earlier call has loaded it, else None; never builds, never waits."""
    lib = _LOADED
    return lib if isinstance(lib, ctypes.CDLL) else None


def prepare() -> None:
    """Build (or load) the library now; `BackendUnavailableError` saying why it cannot be had."""
    library()


def quantize(request: QuantRequest) -> QuantResult | None:
    """`quantize_native` of the request (stochastic rounding with its ``noise``)."""
    r = request
    return quantize_native(r.x, r.fmt, r.spec, r.rounding, r.saturate, r.scale, r.with_stats, r.out, r.noise)


def prepare_in_background() -> None:
    """Build (or load) the library on a daemon thread, so that code which only uses it when `loaded` (the agent's
    statistics) gets it without a build in its own thread."""
    if _LOADED is None:
        threading.Thread(target=_load, name="quantwatch-native-build", daemon=True).start()


def quantize_native(
    x: Tensor,
    fmt: FormatSpec,
    spec: ScalingSpec,
    rounding: Rounding,
    saturate: bool,
    scale: Tensor | None,
    with_stats: bool,
    out: Tensor | None = None,
    noise: Tensor | None = None,
) -> QuantResult | None:
    """``(values, stats or None, scale, amax)`` as `compiled.quantize_fused` returns them, or None when the tensor is
    empty or its values are outside what the kernels handle (NaN/±inf, a scaled value beyond float32, statistics
    beyond the float32 runs' range): the caller then runs another backend. ``out`` (contiguous, x's shape and dtype)
    receives the values. Stochastic rounding reads ``noise``: x's shape, uniform in [0, 1) (`reference.draw_noise`),
    one draw per element as the reference uses them.

    Raises `BackendUnavailableError` when the quantization is unsupported or the library cannot be built, and
    ``ValueError`` for stochastic rounding without ``noise`` of x's shape.
    """
    raise_if_unsupported(NAME, unsupported_reason(x, fmt, spec, rounding, saturate))
    lib = library()
    if x.numel() == 0:
        return None
    draws = _draws(x, rounding, noise)
    x = x.detach()
    values = out if out is not None and out.is_contiguous() else torch.empty_like(x)
    n = x.numel()
    threads = threads_for(n)
    mode, block = _channel_layout(x, spec) if spec.kind is Scaling.CHANNEL else (_MODES[spec.kind], spec.block_size)
    # MX and NVFP4: the block scales, written by the cast (NVFP4: the block amaxes by the scan before).
    scales = torch.empty(n // block, dtype=torch.float32) if mode in (_MX_BLOCK, _NV_BLOCK) else None
    scales_address = scales.data_ptr() if scales is not None else None
    cast_scales_address = scales_address
    channel_scale: Tensor | None = None
    scanned = pass_buffer()
    element_scale = 1.0
    if mode in (_CHANNEL, _COLUMNS):
        channel = _channel_scales(lib, x, fmt, spec, mode, block, scanned, threads)
        if channel is None:
            return None
        channel_scale, cast_in = channel
        cast_scales_address = cast_in.data_ptr()
    elif mode in _TWO_PASS:
        status = lib.qw_scan(
            x.data_ptr(), n, block if mode == _NV_BLOCK else 0, scales_address, scanned.buffer_info()[0], threads
        )
        if status != _STATUS_OK:
            return None
        amax = scanned[5]
        if mode == _TENSOR:
            given = float(scale.to(torch.float32)) if scale is not None else None
            element_scale = given if given is not None else tensor_scale_value(amax, fmt, spec)
            finite = math.isfinite(element_scale)
            if not (finite and element_scale >= MIN_SCALE and _f32(amax) / _f32(element_scale) < MAX_QUOTIENT):
                return None
        else:
            element_scale = float(_f32(amax) / _f32(FP8_E4M3.max_value * FP4_E2M1.max_value)) or 1.0
            # The smallest element scale is the tensor scale times the smallest E4M3 block scale, 2^-6.
            if element_scale * NVFP4_BLOCK_SCALE_MIN < MIN_SCALE:
                return None
    partial = pass_buffer()
    stream = n * 4 >= STREAM_MIN_BYTES and values.data_ptr() % 64 == 0
    status = lib.qw_cast(
        x.data_ptr(),
        values.data_ptr(),
        n,
        *_grid(fmt),
        fmt.max_value,
        mode,
        block,
        element_scale,
        cast_scales_address,
        scales_address,
        int(_may_clip(fmt, spec, scale is not None, rounding)),
        int(stream),
        partial.buffer_info()[0],
        threads,
        draws.data_ptr() if draws is not None else None,
        _NEAREST if draws is None else _STOCHASTIC_INTEGER if fmt.kind is Kind.INT else _STOCHASTIC,
    )
    if status == _STATUS_BAD_ARGUMENT:
        raise BackendUnavailableError("native backend rejected its arguments")
    if status != _STATUS_OK:
        return None
    if mode in _TWO_PASS:  # the scan's fields come from the first pass
        for index in (0, 5, 6, 9):
            partial[index] = scanned[index]
    stats = None
    if with_stats:
        fields = _fields(partial, n)
        if not lane_sums_in_range(fields):
            return None
        stats = RowStats.of(fields)
    if out is not None and values is not out:
        out.copy_(values)
        values = out
    amax_tensor = torch.tensor(partial[5], dtype=torch.float32)
    if channel_scale is not None:
        scale_out = channel_scale.reshape([-1 if d == spec.axis % x.dim() else 1 for d in range(x.dim())])
    else:
        scale_out = _scale_out(x, spec, scales, element_scale)
    return values, stats, scale_out, amax_tensor


def _draws(x: Tensor, rounding: Rounding, noise: Tensor | None) -> Tensor | None:
    """The draws the kernels read (contiguous float32), None to round to nearest; ``ValueError`` without them."""
    if rounding is Rounding.NEAREST:
        return None
    if noise is None:
        raise ValueError("noise: stochastic rounding needs noise (draw_noise)")
    if noise.shape != x.shape:
        raise ValueError(f"noise: needs x's shape {tuple(x.shape)}; got {tuple(noise.shape)}")
    return noise.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _f32(value: float) -> np.float32:
    return np.float32(value)


def tensor_scale_value(amax: float, fmt: FormatSpec, spec: ScalingSpec) -> float:
    """`reference.amax_to_scale` of a float32 ``amax`` as a Python float, in float32 arithmetic like the reference
    (tests/kernels/test_native.py holds the two equal over the whole float32 range, margins and ``pow2``)."""
    with np.errstate(over="ignore", invalid="ignore"):  # as the reference: a margin may overflow, 0 · inf is NaN
        value = _f32(amax) / _f32(fmt.max_value)
        if spec.margin:
            value = value * _f32(2.0**spec.margin)
    if spec.pow2:
        mantissa, exponent = math.frexp(float(value))
        if mantissa != 0.5:  # not a power of two: the next one up, as reference.exact_pow2 builds it (at most 2^127)
            value = _f32(2.0 ** min(exponent, 127) if math.isfinite(mantissa) else 1.0)
    return float(value) if value > 0 else 1.0


def _fields(partial: array[float], numel: int) -> list[float]:
    sum_x2, sum_q2, sum_qx, sum_err2, max_err, amax, nonzero, zeros_q, overflow, nonfinite = partial
    underflow = zeros_q - (numel - nonzero)  # a finite zero always quantizes to zero
    return [numel, sum_x2, sum_q2, sum_qx, sum_err2, max_err, amax, nonzero, underflow, overflow, nonfinite]


def _scale_out(x: Tensor, spec: ScalingSpec, scales: Tensor | None, element_scale: float) -> Tensor:
    if scales is not None:
        leading = x.shape[:-1] if x.dim() else ()
        return scales.reshape(*leading, -1)
    return torch.tensor(element_scale, dtype=torch.float32)


def stats_fields(x: Tensor, q: Tensor, overflow_mask: Tensor | None) -> tuple[float, ...] | None:
    """The `ErrorStats` fields (host values, in ``FIELDS`` order) of contiguous float32 CPU tensors ``q`` against
    ``x`` in one pass of the loaded library (`loaded`), ``overflow_mask`` (bool, contiguous) counting the clipped
    inputs; None when the library is not loaded, or some value is NaN/±inf or outside the float32 runs' range."""
    lib = loaded()
    n = x.numel()
    if lib is None or q.numel() != n or (overflow_mask is not None and overflow_mask.numel() != n):
        return None
    if not (plain(x) and plain(q)):
        return None
    partial = pass_buffer()
    mask = overflow_mask.data_ptr() if overflow_mask is not None else None
    if lib.qw_stats(x.data_ptr(), q.data_ptr(), mask, n, partial.buffer_info()[0], threads_for(n)) != _STATUS_OK:
        return None
    return pass_fields(partial, n)
