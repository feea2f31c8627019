"""The native CPU kernels against the reference: values and scales bit-exact, statistics within 1e-6 relative, rounding
to nearest and stochastically (from the same draws, some of them the values a rounding decision turns on).

`native.quantize_native` is called directly where a test must know the kernels ran (it returns None when it
declines a tensor); `quantize(backend="native")` where the fallback for declined tensors is what is checked.

Every test runs against two builds of the kernels, each where this CPU can execute it: AVX2 (``-march=haswell``: 8
floats a vector, ymm registers) and AVX-512 (``-march=x86-64-v4``: 16 floats, zmm registers); each build is checked
to run its own vector code (`native.vector_isa`), so neither falls back to the other or to the reference unseen.
test_native_builds.py compiles both on any x86-64 host and checks what vector code each holds.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from quantwatch.kernels import (
    FORMATS,
    BackendUnavailableError,
    ErrorStats,
    StatsBatch,
    error_stats,
    native,
    quantize,
)
from quantwatch.kernels import api as api_module
from quantwatch.kernels.api import reference_stats, resolve_quantization
from quantwatch.kernels.formats import Kind, Special
from quantwatch.kernels.options import Scaling, ScalingSpec
from quantwatch.kernels.reference import QuantDetails, amax_to_scale, quantize_reference
from quantwatch.kernels.stats import FlushResult, comparison_fields

FLOAT_FORMATS = [name for name, spec in FORMATS.items() if spec.kind is Kind.FLOAT]
ELEMENT_FORMATS = [name for name, spec in FORMATS.items() if spec.kind in (Kind.FLOAT, Kind.INT)]
ROUNDINGS = ("nearest", "stochastic")
# Draws a stochastic rounding decision turns on: exactly a fraction of the rounding cases (0, a quarter, a half,
# three quarters; noise < fraction is strict), and the extremes torch.rand gives.
EDGE_DRAWS = (0.0, 0.5, 0.25, 0.75, 2.0**-24, 1 - 2.0**-24)


# The vector unit of each build and the -march target that builds it; the CPU flags it needs to run.
BUILDS = {"avx2": "haswell", "avx512": "x86-64-v4"}
CPU_FLAGS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd"}}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


@pytest.fixture(scope="module")
def libraries() -> dict[str, ctypes.CDLL]:
    """Each build, loaded once for the module."""
    return {}


@pytest.fixture(autouse=True, params=list(BUILDS))
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, libraries: dict[str, ctypes.CDLL]) -> str:
    """The build this test runs against (its vector unit): loaded in `native`, and named by
    ``$QUANTWATCH_NATIVE_MARCH`` for whatever the test builds or loads itself."""
    isa: str = request.param
    if not CPU_FLAGS[isa] <= cpu_flags():
        pytest.skip(f"this CPU cannot execute {isa} code (test_native_builds.py checks the build all the same)")
    monkeypatch.setenv(native.MARCH_ENV, BUILDS[isa])
    if isa not in libraries:
        native.reset()
        if not native.available():
            # The dev machines and CI have a C++ compiler (torch.compile needs one too); say why if this one has not.
            pytest.fail(f"native backend unavailable: {native._load()}")
        libraries[isa] = native.library()
    monkeypatch.setattr(native, "_LOADED", libraries[isa])
    assert native.vector_isa() == isa  # the kernels of this build run, not another's
    return isa


@pytest.fixture(scope="module", autouse=True)
def _default_build_afterwards() -> Iterator[None]:
    yield
    native.reset()  # the modules after this one load the default build again


def draws(x: torch.Tensor, rounding: str) -> torch.Tensor | None:
    """Stochastic rounding's uniform draws for ``x`` (None to round to nearest), every fourth one of `EDGE_DRAWS`."""
    if rounding == "nearest":
        return None
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(0))
    picked = noise.view(-1)[::4]
    picked.copy_(torch.tensor(EDGE_DRAWS).repeat(picked.numel() // len(EDGE_DRAWS) + 1)[: picked.numel()])
    return noise


def run_native(
    x: torch.Tensor,
    fmt: str,
    scaling: str | None,
    saturate: bool = True,
    scale: Any = None,
    rounding: str = "nearest",
    noise: torch.Tensor | None = None,
) -> Any:
    element, spec, mode = resolve_quantization(fmt, scaling, rounding)
    return native.quantize_native(x, element, spec, mode, saturate, scale, with_stats=True, noise=noise)


def run_both(
    x: torch.Tensor, fmt: str, scaling: str | None, rounding: str, saturate: bool = True
) -> tuple[Any, QuantDetails, ErrorStats]:
    """`run_native`, and the reference's details and statistics, of one quantization (stochastic: the same `draws`)."""
    noise = draws(x, rounding)
    result = run_native(x, fmt, scaling, saturate, rounding=rounding, noise=noise)
    element, spec, mode = resolve_quantization(fmt, scaling, rounding)
    details = quantize_reference(x, element, spec, mode, saturate, noise=noise)
    return result, details, reference_stats(x, details)


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (the sign of zero counts)."""
    same = got.view(torch.int32) == expected.view(torch.int32)
    assert bool(same.all()), (got[~same][:5], expected[~same][:5])


def finite_sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded values spanning 16 binades, the first two -0.0 and +0.0 (the sign of zero must survive)."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-8, 8, shape, generator=generator).float()
    x = torch.randn(shape, generator=generator) * torch.exp2(exponents)
    x.view(-1)[:2] = torch.tensor([-0.0, 0.0])
    return x


@pytest.mark.parametrize("fmt", ELEMENT_FORMATS)
def test_plain_cast_matches_the_reference_on_every_rounding_case(fmt: str, backends: Any) -> None:
    x = backends.rounding_cases(FORMATS[fmt], finite=True)
    modes = [True] if FORMATS[fmt].special is not Special.NONE else [True, False]
    for saturate in modes:
        for rounding in ROUNDINGS:
            result, details, ref_stats = run_both(x, fmt, "none", rounding, saturate)
            assert result is not None
            assert_bitwise_equal(result[0], details.values)
            backends.assert_same(result[:2], (details.values, ref_stats))
            assert ref_stats.to_dict()["overflow_count"] > 0  # the cases reach past the maximum


@pytest.mark.parametrize("fmt", ELEMENT_FORMATS)
@pytest.mark.parametrize("scaling", ["tensor", "tensor:pow2", "delayed:4:1", "block:32", "block:16", "nvblock:16"])
def test_scaled_casts_match_the_reference(fmt: str, scaling: str, backends: Any) -> None:
    # Shapes: whole vectors; a tail shorter than a vector per thread range; one row of one block.
    shapes = [(64, 96), (33, 160), (1, 64)] if "block" in scaling else [(64, 96), (33, 70), (7,)]
    for (seed, shape), rounding in itertools.product(enumerate(shapes), ROUNDINGS):
        x = finite_sample(shape, seed)
        result, details, ref_stats = run_both(x, fmt, scaling, rounding)
        assert result is not None
        values, stats, scale, amax = result
        assert_bitwise_equal(values, details.values)
        backends.assert_same((values, stats), (details.values, ref_stats))
        assert_bitwise_equal(scale, details.scale)
        assert amax.item() == details.amax.item()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp4_e2m1", "int8", "int4"])
@pytest.mark.parametrize(
    ("scaling", "shape"),
    [
        ("channel", (64, 96)),  # a weight's output channels: whole vectors
        ("channel:0", (40, 17)),  # a vector and a one-element tail per channel
        ("channel:0", (5, 16)),  # the shortest segment the kernels take
        ("channel:1", (3, 7, 20)),  # a middle axis: segments of 20, each channel in 3 of them
        ("channel:-2", (4, 6, 33)),
        ("channel:-1", (50, 33)),  # single elements: rows of 33 channels, two vectors and a tail each
        ("channel:1", (20, 64)),
        ("channel:2", (4, 5, 16)),  # exactly one vector a row
        ("channel:-1", (2, 9, 100)),
    ],
)
def test_channel_scaling_matches_the_reference(fmt: str, scaling: str, shape: tuple[int, ...], backends: Any) -> None:
    x = finite_sample(shape, len(shape))
    x.select(-2 if len(shape) > 2 else 0, 1).zero_()  # an all-zero channel: scale 1
    for rounding in ROUNDINGS:
        result, details, ref_stats = run_both(x, fmt, scaling, rounding)
        assert result is not None
        values, stats, scale, amax = result
        assert_bitwise_equal(values, details.values)
        backends.assert_same((values, stats), (details.values, ref_stats))
        assert scale.shape == details.scale.shape
        assert_bitwise_equal(scale, details.scale)
        assert amax.item() == details.amax.item()


def test_presets_and_odd_scales_match_the_reference(backends: Any) -> None:
    x = finite_sample((48, 128), 7)
    for fmt, rounding in itertools.product(["mxfp8", "mxfp6", "mxfp4", "nvfp4"], ROUNDINGS):
        for factor in [1.0, 2.0**-30, 2.0**30, 3e-5]:
            result, details, ref_stats = run_both(x * factor, fmt, None, rounding)
            assert result is not None, (fmt, factor)
            backends.assert_same(result[:2], (details.values, ref_stats))


def test_a_negative_margin_clips_and_counts_overflow(backends: Any) -> None:
    x = finite_sample((40, 64), 8)
    spec = ScalingSpec(Scaling.DELAYED, history=4, margin=-2)  # a quarter of the amax scale: the top values clip
    native_result = quantize(x, "fp8_e4m3", spec, with_stats=True, backend="native")
    reference = quantize(x, "fp8_e4m3", spec, with_stats=True, backend="reference")
    backends.assert_same(native_result, reference)
    assert_bitwise_equal(native_result[0], reference[0])
    assert native_result[1].to_dict()["overflow_count"] > 0


def test_a_given_scale_clips_and_counts_overflow(backends: Any) -> None:
    x = finite_sample((40, 64), 3)
    for fmt in ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]:
        scale = torch.tensor(x.abs().amax().item() / FORMATS[fmt].max_value / 8)  # an eighth: the top values clip
        result = run_native(x, fmt, "delayed:4", scale=scale)
        assert result is not None
        ref = quantize(x, fmt, "delayed:4", scale=scale, with_stats=True, backend="reference")
        backends.assert_same(result[:2], ref)
        assert result[1].to_dict()["overflow_count"] == ref[1].to_dict()["overflow_count"] > 0


def test_nvfp4_never_clips_where_block_scales_round_down(backends: Any) -> None:
    # Block amaxes swept across whole E4M3 rounding intervals in every binade the block scales span (see the same
    # test of the compiled path): the kernels count no NVFP4 E2M1 overflow, and the reference agrees. Rounding
    # stochastically, the elements just above 6 that a block scale rounded down leaves round up to 8 at times: clipped.
    x = backends.nvfp4_block_sweep()
    for rounding in ROUNDINGS:
        result, details, ref_stats = run_both(x, "nvfp4", None, rounding)
        assert result is not None
        assert_bitwise_equal(result[0], details.values)
        backends.assert_same(result[:2], (details.values, ref_stats))
        assert (ref_stats.to_dict()["overflow_count"] > 0) is (rounding == "stochastic")


# Each over 8 MB (streaming stores): 2,064 columns are 129 NVFP4 blocks a row; 2,063 put a partial vector at the end of
# every channel segment or row of channels (and keep streaming stores off: the next would be unaligned).
# Stochastic rounding: each thread reads the draws of its own range (over 2^16 elements: more than one thread).
LARGE_CASES = [
    ("fp8_e4m3", "tensor", (1024, 2064), "nearest"),
    ("nvfp4", None, (1024, 2064), "nearest"),
    ("int8", "channel:0", (1100, 2063), "nearest"),
    ("fp4_e2m1", "channel:-1", (1100, 2063), "nearest"),
    ("fp8_e4m3", "channel:-1", (1024, 2064), "nearest"),
    ("fp8_e5m2", "block:32", (128, 2080), "stochastic"),
    ("int8", "tensor", (128, 2063), "stochastic"),
]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_tensors_with_streaming_stores_and_any_thread_count(threads: int, build: str, backends: Any) -> None:
    if build == "avx512" and threads != 2:
        pytest.skip("the second build: one thread count (the slowest test here, 5-7 s a run on 2 cores)")
    inputs = {shape: finite_sample(shape, 5) for _, _, shape, _ in LARGE_CASES}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = [run_both(inputs[shape], fmt, scaling, rounding) for fmt, scaling, shape, rounding in LARGE_CASES]
    finally:
        torch.set_num_threads(before)
    for result, details, ref_stats in runs:
        assert result is not None
        backends.assert_same(result[:2], (details.values, ref_stats))


@pytest.mark.parametrize("scaling", ["tensor", "channel", "nvblock:16"])
def test_empty_tensors_are_declined_not_a_crash(scaling: str) -> None:
    for shape in [(0, 32), (32, 0)]:
        assert run_native(torch.empty(shape), "int8", scaling) is None
        values, stats = quantize(torch.empty(shape), "int8", scaling, with_stats=True, backend="native")
        assert values.shape == shape
        assert stats.to_dict()["numel"] == 0


@pytest.mark.parametrize(
    ("case", "x", "scaling"),
    [
        ("NaN", torch.tensor([1.0, float("nan")] * 20), "tensor"),
        ("inf", torch.tensor([1.0, -float("inf")] * 20), "tensor"),
        ("squares below float32's range", torch.full((40,), 1e-30), "tensor"),
        ("scale below 2^-80", torch.full((40,), 2.0**-80), "tensor"),
        ("a channel's scale below 2^-80", torch.cat([torch.ones(1, 20), torch.full((1, 20), 2.0**-80)]), "channel"),
        ("a column's", torch.cat([torch.ones(20, 1), torch.full((20, 19), 2.0**-80)], dim=1), "channel:-1"),
    ],
)
def test_declined_tensors_fall_back_to_an_exact_backend(
    case: str, x: torch.Tensor, scaling: str, backends: Any
) -> None:
    assert run_native(x, "fp8_e4m3", scaling) is None, case
    fallback = quantize(x, "fp8_e4m3", scaling, with_stats=True, backend="native")
    backends.assert_same(fallback, quantize(x, "fp8_e4m3", scaling, with_stats=True, backend="reference"))


@pytest.mark.parametrize(("fmt", "scaling"), [("fp8_e4m3", "none"), ("mxfp4", None), ("fp8_e4m3", "tensor")])
@pytest.mark.parametrize("case", ["NaN", "squares below float32's range"])
def test_in_place_quantization_of_a_declined_tensor_is_exact(
    fmt: str, scaling: str | None, case: str, backends: Any
) -> None:
    # The kernels may write the values before they decline the tensor: the fallback must still see x as it was.
    x = finite_sample((64, 64), 2) if case == "NaN" else torch.full((64, 64), 1e-30)
    x[0, 5] = float("nan") if case == "NaN" else x[0, 5]
    expected = quantize(x, fmt, scaling, with_stats=True, backend="reference")
    in_place = x.clone()
    values, stats = quantize(in_place, fmt, scaling, with_stats=True, backend="native", out=in_place)
    assert values is in_place
    backends.assert_same((values, stats), expected)


def test_in_place_statistics_deferred_to_a_batch_are_filled() -> None:
    x = finite_sample((32, 64), 3)
    expected = quantize(x, "fp8_e4m3", "tensor", with_stats=True, backend="reference")[1].as_tensor()
    batch = StatsBatch()
    with batch.collecting():
        _, stats = quantize(x, "fp8_e4m3", "tensor", with_stats=True, backend="reference", out=x)
    assert batch.flush() == FlushResult()
    assert torch.allclose(stats.as_tensor(), expected, rtol=1e-6, atol=0)


def test_out_receives_the_values_on_every_backend() -> None:
    x = finite_sample((32, 64), 9)
    expected = quantize(x, "fp8_e4m3", "tensor", backend="reference")
    for backend in ["native", "reference", "compiled"]:
        out = torch.full_like(x, math.nan)
        values = quantize(x, "fp8_e4m3", "tensor", backend=backend, out=out)
        assert values is out
        assert_bitwise_equal(out, expected)
    stats_out = torch.empty_like(x)
    values, stats = quantize(x, "mxfp4", with_stats=True, backend="native", out=stats_out)
    assert values is stats_out
    assert stats.to_dict()["numel"] == x.numel()
    in_place = x.clone()
    quantize(in_place, "fp8_e4m3", "tensor", backend="native", out=in_place)
    assert_bitwise_equal(in_place, expected)
    strided = torch.empty(64, 32).T  # x's shape, not contiguous: written through a copy
    quantize(x, "fp8_e4m3", "tensor", backend="native", out=strided)
    assert_bitwise_equal(strided.contiguous(), expected)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (torch.empty(32, 63), "out: needs x's shape"),
        (torch.empty(32, 64, dtype=torch.float64), "out: needs x's shape, dtype"),
        (torch.empty(32, 64, requires_grad=True), "out: must not require grad"),
    ],
)
def test_bad_out_is_a_clear_error(out: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(torch.randn(32, 64), "fp8_e4m3", out=out)
    with pytest.raises(ValueError, match="out: return_details"):
        quantize(torch.randn(32, 64), "fp8_e4m3", out=torch.empty(32, 64), return_details=True)
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor"):
        quantize(torch.randn(32, 64), "fp8_e4m3", out=[0.0])  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("kwargs", "x", "reason"),
    [
        ({"fmt": "fp8_e4m3"}, torch.randn(8, 16).double(), "float32 only"),
        ({"fmt": "e8m0"}, torch.rand(8, 16), "scale element formats"),
        ({"fmt": "fp8_e4m3", "scaling": "channel:-1"}, torch.randn(16, 8), "runs of 1 among 8 channels"),
        ({"fmt": "int8", "scaling": "channel:-1"}, torch.randn(8, 64), "at least 16 rows"),
        ({"fmt": "int8", "scaling": "channel:0"}, torch.randn(8, 15), "runs of 15"),
        ({"fmt": "fp8_e4m3", "scaling": "block:8"}, torch.randn(8, 16), "block size 8"),
        ({"fmt": "mxfp4"}, torch.randn(8, 40), "not a whole number of blocks"),
        ({"fmt": "fp8_e4m3"}, torch.randn(16, 8).T, "non-contiguous"),
        ({"fmt": "fp8_e5m2", "saturate": False}, torch.randn(8, 16), "non-saturating"),
    ],
)
def test_unsupported_quantizations_raise_clearly_and_auto_moves_on(
    kwargs: dict[str, Any], x: torch.Tensor, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(BackendUnavailableError, match=reason):
        quantize(x, backend="native", **kwargs)
    monkeypatch.setattr(api_module, "AUTO_COMPILE_MIN_NUMEL", 1)
    auto = quantize(x, backend="auto", generator=torch.Generator().manual_seed(1), **kwargs)
    reference = quantize(x, backend="reference", generator=torch.Generator().manual_seed(1), **kwargs)
    assert torch.equal(auto, reference)


def test_stochastic_rounding_without_its_draws_is_a_clear_error() -> None:
    element, spec, rounding = resolve_quantization("fp8_e5m2", "block:32", "stochastic")
    x = finite_sample((4, 32), 1)
    with pytest.raises(ValueError, match=r"noise: stochastic rounding needs noise"):
        native.quantize_native(x, element, spec, rounding, True, None, with_stats=True)
    with pytest.raises(ValueError, match=r"noise: needs x's shape \(4, 32\); got \(4, 16\)"):
        native.quantize_native(x, element, spec, rounding, True, None, with_stats=True, noise=torch.rand(4, 16))


def test_stochastic_rounding_runs_natively_on_auto_from_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = native.quantize_native

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(native, "quantize_native", spy)
    x = finite_sample((16, 64), 4)
    got = quantize(x, "fp8_e5m2", "block:32", "stochastic", generator=torch.Generator().manual_seed(5))
    expected = quantize(
        x, "fp8_e5m2", "block:32", "stochastic", generator=torch.Generator().manual_seed(5), backend="reference"
    )
    assert calls == [True]
    assert_bitwise_equal(got, expected)


def test_auto_runs_the_native_kernels_from_its_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = native.quantize_native

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "quantize_native", spy)
    monkeypatch.setattr(api_module, "AUTO_NATIVE_MIN_NUMEL", 1000)
    quantize(torch.randn(10, 10), "mxfp4")
    assert calls == []
    quantize(torch.randn(40, 64), "mxfp4")
    assert calls == ["fp4_e2m1"]


def test_a_failed_build_is_a_clear_error_and_auto_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("QUANTWATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(api_module, "AUTO_COMPILE_MIN_NUMEL", 1)
    native.reset()
    try:
        with pytest.raises(BackendUnavailableError, match=r"false failed to build native\.cpp"):
            quantize(torch.randn(8, 16), "fp8_e4m3", backend="native")
        x = finite_sample((8, 16), 1)
        with caplog.at_level(logging.WARNING):
            values = quantize(x, "fp8_e4m3", "tensor")
        assert_bitwise_equal(values, quantize(x, "fp8_e4m3", "tensor", backend="reference"))
        assert list(tmp_path.iterdir()) == []  # no partial build left behind
        assert caplog.text.count("native kernels unavailable, CPU quantization falls back") == 1
    finally:
        native.reset()


def test_builds_are_cached_by_source_flags_and_machine(tmp_path: Path, build: str) -> None:
    if build == "avx512":
        pytest.skip("the cache is the same for every build: compiled once, for the AVX2 build")
    first = native.build(tmp_path)
    built = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first
    assert first.stat().st_mtime_ns == built
    umask = os.umask(0)
    os.umask(umask)
    assert first.stat().st_mode & 0o777 == 0o755 & ~umask  # readable by the other users of a shared cache
    assert first.parent == tmp_path
    assert first.name.startswith("native-")


def _stats_pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    generator = torch.Generator().manual_seed(21)
    normal = torch.randn(1 << 20, generator=generator)
    wide = normal * 10.0 ** (torch.rand(1 << 20, generator=generator) * 26 - 15)  # squares over 52 decades
    offset = 1 + 1e-3 * normal  # same-sign values of one magnitude: where float32 running sums lose the most
    one_ulp = normal.clone()
    one_ulp[12345] = torch.nextafter(one_ulp[12345], torch.tensor(torch.inf))
    clipped = quantize(normal, "fp8_e5m2", "tensor", return_details=True)
    arbitrary = torch.randn(1001, generator=generator)  # q with zeros where x has none and the reverse
    q_arbitrary = arbitrary.clone()
    q_arbitrary[::3] = 0
    arbitrary[1::7] = 0
    return {
        "fp8 per tensor": (normal, quantize(normal, "fp8_e4m3", "tensor"), None),
        "nvfp4 of a wide range": (wide, quantize(wide, "nvfp4"), None),
        "e5m2 near one": (offset, quantize(offset, "fp8_e5m2", "tensor"), None),
        "one ulp apart": (normal, one_ulp, None),
        "equal": (normal, normal.clone(), None),
        "negated": (wide, -wide, None),
        "with an overflow mask": (normal, clipped.values, clipped.overflow_mask | (normal > 2.5)),
        "an arbitrary pair, odd length": (arbitrary, q_arbitrary, None),
    }


@pytest.mark.parametrize("case", list(_stats_pairs()))
def test_one_pass_statistics_hold_1e6_against_float64(case: str, backends: Any) -> None:
    x, q, overflow = _stats_pairs()[case]
    fields = native.stats_fields(x, q, overflow)
    assert fields is not None
    backends.assert_fields_match_float64(list(fields), x, q, overflow)
    if case == "equal":
        assert ErrorStats.from_tensor(torch.tensor(fields)).to_dict()["cosine"] == 1.0
    if case == "negated":
        assert ErrorStats.from_tensor(torch.tensor(fields)).to_dict()["cosine"] == -1.0


@pytest.mark.parametrize(
    ("x", "q"),
    [
        (torch.randn(64), torch.randn(32)),  # not the same size: never read past the shorter one
        (torch.tensor([1.0, float("nan"), 2.0] * 7), torch.tensor([1.0, 0.0, 2.0] * 7)),
        (torch.tensor([1.0, 2.0] * 9), torch.tensor([1.0, float("inf")] * 9)),
        (torch.full((40,), 1e-30), torch.full((40,), 1.5e-30)),
    ],
)
def test_one_pass_statistics_decline_what_they_cannot_sum(x: torch.Tensor, q: torch.Tensor) -> None:
    assert native.stats_fields(x, q, None) is None


@pytest.fixture
def one_pass_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The numel of each call of `native.stats_fields` from here on (the calls go through)."""
    calls: list[int] = []
    real = native.stats_fields

    def spy(x: torch.Tensor, q: torch.Tensor, overflow: torch.Tensor | None) -> Any:
        calls.append(x.numel())
        return real(x, q, overflow)

    monkeypatch.setattr(native, "stats_fields", spy)
    return calls


def test_error_stats_use_the_one_pass_kernel_once_loaded(
    one_pass_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = one_pass_calls
    x = finite_sample((64, 64), 4)
    q = quantize(x, "fp8_e4m3", "tensor", backend="reference")
    fast = error_stats(x, q, "fp8_e4m3").as_tensor()
    assert calls == [x.numel()]
    monkeypatch.setattr(native, "_LOADED", None)  # not loaded: NumPy's passes, never a build in this thread
    numpy_path = error_stats(x, q, "fp8_e4m3").as_tensor()
    assert calls == [x.numel()]
    assert torch.allclose(fast, numpy_path, rtol=1e-6, atol=0)


@pytest.mark.parametrize("error", [True, False])
def test_comparisons_use_the_one_pass_kernel_once_loaded(
    error: bool, one_pass_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = one_pass_calls
    x = finite_sample((64, 96), 9)
    q = x * 1.01 + 0.003  # a comparison of two outputs, not a quantization
    fast = comparison_fields(x, q, error=error)
    same = comparison_fields(x, x.clone(), error=error)
    assert calls == [x.numel(), x.numel()]
    assert same[1] == same[2] == same[3]  # q == x: the same products in the same order, a cosine of exactly 1
    monkeypatch.setattr(native, "_LOADED", None)  # not loaded: NumPy's dot products
    numpy_path = comparison_fields(x, q, error=error)
    assert len(calls) == 2
    assert fast[0] == numpy_path[0] == x.numel()
    assert fast[1:4] == pytest.approx(numpy_path[1:4], rel=1e-6)
    assert math.isnan(fast[4]) != error
    if error:
        assert fast[4] == pytest.approx(numpy_path[4], rel=1e-6)
    assert [math.isnan(v) for v in fast[5:7]] == [True, True]
    assert fast[7:] == (0.0, 0.0, 0.0, 0.0)


def test_the_tensor_scale_is_the_references_over_the_float32_range() -> None:
    bits = torch.cat(
        [
            torch.randint(0, 0x7F800000, (4000,), generator=torch.Generator().manual_seed(2), dtype=torch.int32),
            torch.tensor([0, 1, 2, 0x7FFFFF, 0x800000, 0x3F800000, 0x3F800001, 0x7F7FFFFF], dtype=torch.int32),
        ]
    )
    amaxes = bits.view(torch.float32)
    for fmt in ["fp8_e4m3", "fp8_e5m2", "fp4_e1m2"]:
        element = FORMATS[fmt]
        for pow2 in (False, True):
            for margin in (0, 3, 200):
                spec = ScalingSpec(Scaling.TENSOR, pow2=pow2, margin=margin)
                expected = amax_to_scale(amaxes, element, pow2=pow2, margin=margin)
                got = torch.tensor([native.tensor_scale_value(a, element, spec) for a in amaxes.tolist()])
                assert_bitwise_equal(got, expected)


def test_a_child_forked_while_the_library_is_being_built_can_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_LOADED", None)
    with native._LOCK:  # as the agent's background build holds it
        pid = os.fork()
        if pid == 0:  # the child: it must not wait forever for a lock no thread of its own holds
            signal.alarm(60)
            os._exit(0 if native.available() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_wrapper_tensor_subclass_is_declined_and_quantized_from_its_values() -> None:
    """A wrapper subclass (torchao's FSDP float8 weight) has no storage of its own values: native reads none of it, and
    ``quantize`` gives what its values give through torch's ops."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils")
    from torchao.float8.float8_linear import LinearMMConfig

    w = torch.randn(16, 32)
    wrapped = fsdp_utils.WeightWithDynamicFloat8CastTensor(w, LinearMMConfig(), torch.float8_e4m3fn)
    with pytest.raises(BackendUnavailableError, match="tensor subclass WeightWithDynamicFloat8CastTensor"):
        run_native(wrapped, "fp8_e4m3", "tensor")
    values, stats = quantize(wrapped, "fp8_e4m3", "tensor", with_stats=True)
    expected, expected_stats = quantize(w, "fp8_e4m3", "tensor", with_stats=True)
    assert torch.equal(torch.as_tensor(values).detach().clone(), expected)
    assert stats.to_dict() == pytest.approx(expected_stats.to_dict(), rel=1e-6)  # summed by torch, not in float64
