"""The Prometheus exposition: golden bytes under a frozen clock, the cardinality cap, TTL, and promtool's linter."""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from quantwatch import __version__
from quantwatch.service.alerts.columns import ColumnStates
from quantwatch.service.alerts.evaluator import SeriesState, SeriesStatus
from quantwatch.service.exposition import (
    AlertSeries,
    BackgroundRenderer,
    IngestMetrics,
    LatestValueCache,
    QuantWatchCollector,
    StepValues,
    alert_series_source,
    layer_family_name,
    render_exposition,
    run_family_name,
)
from quantwatch.service.exposition.alert_states import EXPORTED_ALERT_STATES, STATE_RANK, StoredSeries

DATA = Path(__file__).parent / "data"


class FrozenClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def registry_for(cache: LatestValueCache, ingest: IngestMetrics | None = None, alerts=None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(QuantWatchCollector(cache, ingest, alerts))
    return registry


def samples(registry: CollectorRegistry, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Parse the exposition with prometheus_client's parser: {sorted labels: value} of one family."""
    text = render_exposition(registry).decode()
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == family:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def golden_scenario() -> CollectorRegistry:
    clock = FrozenClock(1_764_467_200.0)
    cache = LatestValueCache(top_k=2, clock=clock)
    ingest = IngestMetrics()
    layers = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", 'odd"name\\x']
    cache.observe(
        "gpt-fp4",
        0,
        layers,
        [
            StepValues(
                10,
                {"output_rel_l2": np.array([0.01, 0.02, 0.03], np.float32)},
                {"loss": 2.75, "loss_shadow": 2.5},
            ),
            StepValues(
                11,
                {
                    "output_rel_l2": np.array([0.062, 0.031, 0.0], np.float32),
                    "output_cosine": np.array([0.998, 0.5, 1.0], np.float32),
                    "nonfinite_count": np.array([0, 3, 5], np.float32),
                },
                {"loss": 2.71},
                missing={"output_rel_l2": np.array([False, False, True])},
            ),
        ],
    )
    cache.observe("run/b", 1, ["fc"], [StepValues(7, {"underflow_ratio": np.array([np.nan], np.float32)})])
    ingest.observe_points(14)
    ingest.observe_request(200, 0.004)
    ingest.observe_request(200, 0.002, duplicate=True)
    ingest.observe_request(422, 0.0007)
    ingest.observe_request(503, 0.3)

    def alerts():
        return [
            AlertSeries("output_rel_l2_high", "gpt-fp4", "blocks.0.attn.qkv", 3, "firing"),
            AlertSeries("output_rel_l2_high", "gpt-fp4", "blocks.0.mlp.fc1", 0, "resolved"),
            AlertSeries("loss_diverges", "gpt-fp4", "", 1, "pending"),
        ]

    return registry_for(cache, ingest, alerts)


def test_exposition_matches_golden_bytes_under_a_frozen_clock() -> None:
    got = render_exposition(golden_scenario())
    expected = (DATA / "exposition.golden.prom").read_text().replace("{version}", __version__).encode()
    assert got == expected


def test_fast_writer_writes_what_prometheus_client_writes() -> None:
    registry = golden_scenario()
    assert render_exposition(registry) == generate_latest(registry)


def test_cap_exports_the_worst_k_layers_per_run_and_metric() -> None:
    rng = np.random.default_rng(7)
    cache = LatestValueCache(top_k=8, clock=FrozenClock(100.0))
    layers = [f"layers.{i}" for i in range(200)]
    expected: dict[tuple[str, str], set[str]] = {}
    for run in ("a", "b"):
        rel = rng.random(200).astype(np.float32)
        rel[17] = np.nan  # non-finite is the worst of all
        cos = rng.random(200).astype(np.float32)
        cache.observe(run, 0, layers, [StepValues(5, {"output_rel_l2": rel, "output_cosine": cos})])
        worst_rel = {layers[17], *(layers[i] for i in np.argsort(np.nan_to_num(rel, nan=-1))[::-1][:7])}
        expected[(run, "output_rel_l2")] = worst_rel
        expected[(run, "output_cosine")] = {layers[i] for i in np.argsort(cos)[:8]}
    registry = registry_for(cache)
    for metric in ("output_rel_l2", "output_cosine"):
        got = samples(registry, layer_family_name(metric))
        assert len(got) == 16
        for run in ("a", "b"):
            exported = {dict(k)["layer"] for k in got if dict(k)["run"] == run}
            assert exported == expected[(run, metric)]
    omitted = samples(registry, "quantwatch_exposition_layer_series_omitted")
    assert omitted == {(("metric", "output_cosine"),): 384.0, (("metric", "output_rel_l2"),): 384.0}
    assert samples(registry, "quantwatch_exposition_layer_values_omitted_total") == {(): 768.0}


def test_cap_keeps_other_ranks_and_replaces_remeasured_layers() -> None:
    cache = LatestValueCache(top_k=3, clock=FrozenClock(0.0))
    layers = ["l0", "l1", "l2"]
    cache.observe("r", 0, layers, [StepValues(1, {"output_rel_l2": np.array([0.5, 0.4, 0.1], np.float32)})])
    cache.observe("r", 1, layers, [StepValues(1, {"output_rel_l2": np.array([0.45, 0.01, 0.01], np.float32)})])
    got = samples(registry_for(cache), "quantwatch_layer_output_rel_l2_ratio")
    assert {(dict(k)["rank"], dict(k)["layer"]): v for k, v in got.items()} == pytest.approx(
        {("0", "l0"): 0.5, ("0", "l1"): 0.4, ("1", "l0"): 0.45}
    )
    # rank 0 measures again: its l0 improves and drops below rank 1's l0 and rank 0's l2.
    cache.observe("r", 0, layers, [StepValues(2, {"output_rel_l2": np.array([0.001, 0.4, 0.3], np.float32)})])
    got = samples(registry_for(cache), "quantwatch_layer_output_rel_l2_ratio")
    assert {(dict(k)["rank"], dict(k)["layer"]): v for k, v in got.items()} == pytest.approx(
        {("0", "l1"): 0.4, ("0", "l2"): 0.3, ("1", "l0"): 0.45}
    )


def test_unmeasured_layers_keep_their_previous_value() -> None:
    cache = LatestValueCache(clock=FrozenClock(0.0))
    cache.observe("r", 0, ["a", "b"], [StepValues(1, {"amax": np.array([1.0, 2.0], np.float32)})])
    cache.observe(
        "r",
        0,
        ["a", "b"],
        [StepValues(2, {"amax": np.array([5.0, 0.0], np.float32)}, missing={"amax": np.array([False, True])})],
    )
    got = samples(registry_for(cache), "quantwatch_layer_amax")
    assert {dict(k)["layer"]: v for k, v in got.items()} == {"a": 5.0, "b": 2.0}


def test_an_older_batch_does_not_overwrite_the_present() -> None:
    cache = LatestValueCache(clock=FrozenClock(0.0))
    cache.observe("r", 0, ["a"], [StepValues(9, {"amax": np.array([9.0], np.float32)}, {"loss": 1.0})])
    cache.observe("r", 0, ["a"], [StepValues(3, {"amax": np.array([3.0], np.float32)}, {"loss": 7.0})])
    registry = registry_for(cache)
    assert list(samples(registry, "quantwatch_layer_amax").values()) == [9.0]
    assert list(samples(registry, "quantwatch_run_loss").values()) == [1.0]
    assert list(samples(registry, "quantwatch_run_last_step").values()) == [9.0]


def test_idle_runs_drop_out_after_the_ttl() -> None:
    clock = FrozenClock(1000.0)
    cache = LatestValueCache(run_ttl_seconds=60, clock=clock)
    cache.observe("old", 0, ["a"], [StepValues(1, {"amax": np.array([1.0], np.float32)})])
    clock.now += 50
    cache.observe("new", 0, ["a"], [StepValues(1, {"amax": np.array([1.0], np.float32)})])
    registry = registry_for(cache)
    assert {dict(k)["run"] for k in samples(registry, "quantwatch_layer_amax")} == {"old", "new"}
    clock.now += 11
    assert {dict(k)["run"] for k in samples(registry, "quantwatch_layer_amax")} == {"new"}
    assert samples(registry, "quantwatch_exposition_runs_expired_total") == {(): 1.0}


def test_non_finite_values_are_exported_as_such() -> None:
    cache = LatestValueCache(clock=FrozenClock(0.0))
    values = np.array([np.nan, np.inf, -np.inf], np.float32)
    cache.observe("r", 0, ["a", "b", "c"], [StepValues(1, {"output_sqnr_db": values})])
    got = {dict(k)["layer"]: v for k, v in samples(registry_for(cache), "quantwatch_layer_output_sqnr_db").items()}
    assert math.isnan(got["a"])
    assert got["b"] == math.inf
    assert got["c"] == -math.inf


@pytest.mark.parametrize(("kwargs", "field"), [({"top_k": 0}, "top_k"), ({"run_ttl_seconds": -1}, "run_ttl_seconds")])
def test_bad_cache_settings_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LatestValueCache(**kwargs)  # type: ignore[arg-type]


def test_a_metric_array_of_the_wrong_length_is_refused() -> None:
    cache = LatestValueCache()
    with pytest.raises(ValueError, match=r"metrics\.amax"):
        cache.observe("r", 0, ["a", "b"], [StepValues(1, {"amax": np.array([1.0], np.float32)})])


def test_family_names_follow_the_naming_scheme() -> None:
    assert layer_family_name("output_rel_l2") == "quantwatch_layer_output_rel_l2_ratio"
    assert layer_family_name("underflow_ratio") == "quantwatch_layer_underflow_ratio"
    assert layer_family_name("nonfinite_count") == "quantwatch_layer_nonfinite_values"
    assert layer_family_name("My-Metric.count") == "quantwatch_layer_my_metric_count_value"
    assert run_family_name("loss_shadow") == "quantwatch_run_loss_shadow"
    assert run_family_name("step_seconds") == "quantwatch_run_step_seconds"
    # custom names never merge into a canonical family
    assert layer_family_name("output_rel_l2_ratio") == "quantwatch_layer_output_rel_l2_ratio_custom"
    assert run_family_name("last_step") == "quantwatch_run_last_step_custom"


def test_promtool_check_metrics_reports_nothing() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: .ci/run installs the Debian package prometheus"
    cache = LatestValueCache(top_k=4, clock=FrozenClock(10.0))
    layers = [f"blocks.{i}.mlp.fc1" for i in range(12)]
    rng = np.random.default_rng(1)
    metrics = ["output_rel_l2", "output_cosine", "output_sqnr_db", "underflow_ratio", "nonfinite_count", "scale"]
    for run in ("a", "b", "c"):
        arrays = {m: rng.random(12).astype(np.float32) for m in metrics}
        scalars = {"loss": 2.0, "loss_shadow": 1.9, "tokens_per_second": 1e4, "device_memory_bytes": 2.0**33}
        cache.observe(run, 0, layers, [StepValues(4, arrays, scalars)])
    ingest = IngestMetrics()
    ingest.observe_points(100)
    ingest.observe_request(200, 0.01)
    alerts = [AlertSeries("output_rel_l2_high", "a", layers[0], 4, "firing")]
    text = render_exposition(registry_for(cache, ingest, lambda: alerts))
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == b""
    assert result.stderr == b""


def test_fast_writer_spells_values_of_every_magnitude_as_prometheus_client_does() -> None:
    rng = np.random.default_rng(3)
    magnitudes = 10.0 ** rng.integers(-40, 38, 4000)
    values = (rng.standard_normal(4000) * magnitudes).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-4, -1e-4, 1e6, 999999.9, 1e16, np.nan, np.inf, -np.inf, 3.4e38], np.float32)
    values = np.concatenate([values, special])
    cache = LatestValueCache(top_k=len(values), clock=FrozenClock(0.0))
    layers = [f"l{i}" for i in range(len(values))]
    cache.observe("r", 0, layers, [StepValues(1, {"amax": values})])
    registry = registry_for(cache)
    fast = render_exposition(registry)
    assert fast == generate_latest(registry)
    exported = {dict(k)["layer"]: v for k, v in samples(registry, "quantwatch_layer_amax").items()}
    for layer, value in zip(layers, values.tolist(), strict=True):
        # Prometheus reads back exactly the float32 that was ingested.
        assert np.float32(exported[layer]) == np.float32(value) or (math.isnan(value) and math.isnan(exported[layer]))


def test_fast_writer_matches_prometheus_client_on_random_figures_of_every_class() -> None:
    # Random float32 codes (subnormals, NaN, ±Inf, every exponent), ±0, powers of two, ties; several ranks, so that
    # the cap mixes them, and a second batch that changes every value between two scrapes.
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        powers = np.exp2(np.arange(-149, 128, dtype=np.float64)).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 4707.21875, 1e-4, 1e6, 1e-45, 3.4028235e38], np.float32)
    values = np.concatenate([codes, powers, -powers, edges])
    values = np.where(np.isnan(values), np.float32(np.nan), values)
    layers = [f"l{i}" for i in range(len(values))]
    cache = LatestValueCache(top_k=len(values) // 2, clock=FrozenClock(0.0))
    registry = registry_for(cache)
    for step, rank in ((1, 0), (1, 1), (2, 0)):
        cache.observe("r", rank, layers, [StepValues(step, {"amax": rng.permutation(values)})])
        assert render_exposition(registry) == generate_latest(registry)


def test_alert_series_are_capped_per_rule_and_run_and_follow_the_run_ttl() -> None:
    clock = FrozenClock(0.0)
    cache = LatestValueCache(top_k=3, run_ttl_seconds=10, clock=clock)
    cache.observe("live", 0, ["a"], [StepValues(1, {"amax": np.array([1.0], np.float32)})])
    alerts = [AlertSeries("r", "live", f"l{i}", i, "pending" if i < 3 else "inactive") for i in range(1, 9)]
    alerts.append(AlertSeries("r", "live", "l0", 1, "firing"))
    alerts.append(AlertSeries("r", "gone", "l1", 7, "firing"))  # a run the cache does not know (expired)
    registry = registry_for(cache, alerts=lambda: alerts)
    streaks = {dict(k)["layer"]: v for k, v in samples(registry, "quantwatch_alert_streak_steps").items()}
    # firing first, then pending, then the longest streaks
    assert streaks == {"l0": 1.0, "l2": 2.0, "l1": 1.0}
    states = {(dict(k)["layer"], dict(k)["state"]) for k in samples(registry, "quantwatch_alert_state")}
    assert states == {("l0", "firing"), ("l1", "pending"), ("l2", "pending")}
    clock.now += 11
    assert samples(registry, "quantwatch_alert_streak_steps") == {}


def mixed_ranks_scenario(cache: LatestValueCache, rng: np.random.Generator, step: int) -> None:
    """Batches of two runs, the second with two ranks, so that slots mix ranks and the cap leaves values out."""
    layers = [f"blocks.{i}.mlp.fc1" for i in range(40)]
    for run, rank in (("a", 0), ("b", 0), ("b", 1)):
        metrics = {m: rng.random(40).astype(np.float32) for m in ("output_rel_l2", "output_cosine", "amax")}
        cache.observe(run, rank, layers, [StepValues(step, metrics, {"loss": float(rng.random())})])


def test_rendering_changed_slots_ahead_of_a_scrape_gives_the_same_exposition() -> None:
    ahead, at_scrape = (LatestValueCache(top_k=8, clock=FrozenClock(50.0)) for _ in range(2))
    for step in range(3):
        for cache in (ahead, at_scrape):
            mixed_ranks_scenario(cache, np.random.default_rng(step), step)
        assert ahead.render_changed(runs_per_hold=1) == 2 * 3  # two runs, three metrics each
        assert ahead.render_changed() == 0  # nothing changed since
        assert render_exposition(registry_for(ahead)) == render_exposition(registry_for(at_scrape))
    mixed_ranks_scenario(ahead, np.random.default_rng(9), 9)
    render_exposition(registry_for(ahead))  # the scrape rendered what changed: nothing left for the renderer
    assert ahead.render_changed() == 0


def test_background_renderer_renders_what_batches_changed_and_stops() -> None:
    def renderer_threads() -> int:  # other tests' collectors may have theirs running
        return sum(thread.name == "quantwatch-exposition" for thread in threading.enumerate())

    cache = LatestValueCache(top_k=8)
    renderer = BackgroundRenderer(cache, interval_seconds=0.01)
    before = renderer_threads()
    renderer.start()
    assert renderer_threads() == before + 1
    try:
        cache.snapshot()  # someone scrapes
        mixed_ranks_scenario(cache, np.random.default_rng(0), 1)
        deadline = time.monotonic() + 30
        while renderer.slots_rendered < 6:
            assert time.monotonic() < deadline, "the renderer rendered nothing"
            time.sleep(0.01)
    finally:
        renderer.stop()
    assert renderer.slots_rendered == 6
    assert renderer.cpu_seconds > 0
    assert renderer_threads() == before


def test_background_renderer_waits_for_someone_to_scrape() -> None:
    cache = LatestValueCache(top_k=8)
    renderer = BackgroundRenderer(cache, interval_seconds=0.005, idle_after_seconds=60)
    renderer.start()
    try:
        mixed_ranks_scenario(cache, np.random.default_rng(0), 1)
        time.sleep(0.2)  # forty passes' worth
        assert renderer.slots_rendered == 0  # never scraped
        cache.scraped_at = time.monotonic() - 61
        time.sleep(0.2)
        assert renderer.slots_rendered == 0  # not scraped for longer than idle_after_seconds
    finally:
        renderer.stop()
    assert cache.render_changed() == 6  # the slots were left for a scrape


@pytest.mark.parametrize("field", ["interval_seconds", "idle_after_seconds"])
@pytest.mark.parametrize("value", [0, -1.0, True])
def test_bad_renderer_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        BackgroundRenderer(LatestValueCache(), **{field: value})


def test_scrapes_concurrent_with_ingest_and_the_renderer_are_whole_and_never_stale() -> None:
    # A real ingest thread and the background renderer against scrapes from this thread: every scrape parses, holds
    # at most K layers per (run, metric), and shows each run's newest batch at least as new as before the scrape.
    cache = LatestValueCache(top_k=8)
    registry = registry_for(cache)
    renderer = BackgroundRenderer(cache, interval_seconds=0.001)
    stopping = threading.Event()
    sent: dict[str, int] = {}  # run -> newest step observed, written before the step is visible to a scrape
    errors: list[BaseException] = []

    rng = np.random.default_rng(3)
    layers = [f"blocks.{i}.attn.qkv" for i in range(64)]

    def send(step: int) -> None:
        for run in ("r0", "r1", "r2"):
            values = {m: rng.random(64).astype(np.float32) for m in ("output_rel_l2", "output_cosine")}
            cache.observe(run, 0, layers, [StepValues(step, values)])
            sent[run] = step

    def ingest() -> None:
        step = 1
        try:
            while not stopping.is_set():
                step += 1
                send(step)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    send(1)  # every run and metric exists before the first scrape
    feeder = threading.Thread(target=ingest)
    renderer.start()
    feeder.start()
    try:
        scrapes = 0
        while scrapes < 40 or renderer.slots_rendered == 0:
            before = dict(sent)
            text = render_exposition(registry).decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            steps = {s.labels["run"]: s.value for s in families["quantwatch_run_last_step"].samples}
            assert all(steps[run] >= step for run, step in before.items())
            for metric in ("output_rel_l2", "output_cosine"):
                per_run: dict[str, int] = {}
                for sample in families[layer_family_name(metric)].samples:
                    per_run[sample.labels["run"]] = per_run.get(sample.labels["run"], 0) + 1
                assert all(count == 8 for count in per_run.values())
            scrapes += 1
            assert scrapes < 10_000, "the renderer never rendered while ingest ran"
    finally:
        stopping.set()
        feeder.join()
        renderer.stop()
    assert errors == []
    assert render_exposition(registry) == generate_latest(registry)


def _per_series_merge(
    live: list[tuple[str, int, str, Any]], stored: list[StoredSeries]
) -> dict[tuple, tuple[int, str]]:
    """The exposition's alert series as it merged them one series object at a time (the oracle): every rank's series
    by (rule, run, rank, layer), the evaluator's over the restored; those with a streak or pending or firing
    combined per (rule, run, layer), longest streak and most severe state."""
    latest = {(s.rule, s.run, s.rank, s.layer): (s.status, s.streak) for s in stored}
    for run, rank, _, states in live:
        for (rule, layer), state in states.items():
            latest[(rule, run, rank, layer)] = (state.status.value, state.streak)
    merged: dict[tuple, tuple[int, str]] = {}
    for (rule, run, _, layer), (status, streak) in latest.items():
        if streak <= 0 and status not in EXPORTED_ALERT_STATES:
            continue
        longest, state = merged.get((rule, run, layer), (0, "inactive"))
        if STATE_RANK.get(status, 0) > STATE_RANK.get(state, 0):
            state = status
        merged[(rule, run, layer)] = (max(longest, streak), state)
    return merged


def test_alert_series_combine_ranks_as_the_per_series_merge_did() -> None:
    """Ranks' column states combined as arrays give what merging every series did: ranks sharing their layers and
    not, unseen layers, scalar rules, and restored series that the evaluator's own replace or do not."""
    rng = np.random.default_rng(7)
    statuses = list(SeriesStatus)
    for _ in range(60):
        layers = tuple(f"l{i}" for i in range(int(rng.integers(1, 9))))
        live: list[tuple[str, int, str, Any]] = []
        for run in ("a", "b")[: int(rng.integers(1, 3))]:
            for rank in range(int(rng.integers(1, 5))):
                for rule in ("r1", "r2"):
                    own = layers if rng.random() < 0.8 else layers[::-1][: max(1, len(layers) - 1)]
                    n = len(own)
                    live.append(
                        (
                            run,
                            rank,
                            rule,
                            ColumnStates(
                                rule,
                                own,
                                rng.random(n) < 0.8,
                                rng.integers(0, len(statuses), n).astype(np.int8),
                                rng.integers(0, 50, n),
                                rng.integers(0, 4, n) * (rng.random(n) < 0.6),
                                np.zeros(n, dtype=np.int64),
                                rng.random(n),
                            ),
                        )
                    )
                status = statuses[int(rng.integers(len(statuses)))]
                live.append((run, rank, "loss", {("loss", ""): SeriesState(status, 3, int(rng.integers(0, 3)))}))
        stored = [
            StoredSeries(
                str(rng.choice(["r1", "r2", "loss"])),
                str(rng.choice(["a", "b", "gone"])),
                int(rng.integers(0, 5)),
                str(rng.choice([*layers, "", "old"])),
                statuses[int(rng.integers(len(statuses)))].value,
                int(rng.integers(0, 6)),
            )
            for _ in range(int(rng.integers(0, 12)))
        ]
        # The database holds one row per (rule, run, rank, layer).
        stored = list({(s.rule, s.run, s.rank, s.layer): s for s in stored}.values())
        engine = SimpleNamespace(latest_states=lambda live=live: live)
        got = {
            (a.rule, a.run, a.layer): (a.streak_steps, a.state)
            for a in alert_series_source(engine, lambda s=stored: s)()
        }
        assert got == _per_series_merge(live, stored)
