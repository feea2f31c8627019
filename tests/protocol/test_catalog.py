"""The catalogue is the one place a metric is named: what it holds reaches every consumer on both sides of the wire."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantwatch import protocol

# Runs in a fresh interpreter: the catalogue module is loaded from its own source with one more metric appended,
# before anything else imports it, and every consumer is then asked about that metric.
_ADDED_METRIC_PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys
    import quantwatch.protocol.catalog as original
    source = open(original.__file__).read().replace(
        "_LAYER_MEASURES = (",
        "_LAYER_MEASURES = (\\n    _layer('probe_rel_l2', 'higher_is_worse', 'ratio', 'a metric added by a test'),",
        1,
    )
    spec = importlib.util.spec_from_loader("quantwatch.protocol.catalog", loader=None)
    patched = importlib.util.module_from_spec(spec)
    patched.__file__ = original.__file__
    sys.modules["quantwatch.protocol.catalog"] = patched
    exec(compile(source, original.__file__, "exec"), patched.__dict__)
    for name in [m for m in sys.modules if m == "quantwatch.protocol" or m.startswith("quantwatch.protocol.")]:
        if name != "quantwatch.protocol.catalog":
            del sys.modules[name]

    import quantwatch.agent as qw
    from fastapi.testclient import TestClient
    from quantwatch.service import Settings, create_app
    from quantwatch.service.alerts.rules import Rule
    from quantwatch.service.api.routes.ingest import BATCH_SCHEMA
    from quantwatch.service.exposition import layer_family_name

    qw.Schedule({"probe_rel_l2": 1})
    rule = Rule(name="probe", metric="probe_rel_l2", op=">", threshold=0.5)
    app = create_app(Settings(database_url="sqlite:///" + sys.argv[1]))
    with TestClient(app) as client:
        served = [m["name"] for m in client.get("/api/v1/catalog").json()["metrics"]]
    step = BATCH_SCHEMA["properties"]["steps"]["items"]["properties"]
    print(json.dumps({
        "agent": "probe_rel_l2" in qw.LAYER_METRICS,
        "schema": "probe_rel_l2" in step["metrics"]["properties"],
        "rule": rule.metric,
        "family": layer_family_name("probe_rel_l2"),
        "endpoint": "probe_rel_l2" in served,
    }))
    """
)


@pytest.mark.slow
def test_a_metric_added_to_the_catalogue_reaches_every_consumer(sqlite_template: Path, tmp_path: Path) -> None:
    database = tmp_path / "probe.db"
    shutil.copy(sqlite_template, database)
    out = subprocess.run(
        [sys.executable, "-c", _ADDED_METRIC_PROBE, str(database)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "agent": True,
        "schema": True,
        "rule": "probe_rel_l2",
        "family": "quantwatch_layer_probe_rel_l2_ratio",
        "endpoint": True,
    }


def test_catalogue_families_follow_the_naming_rules() -> None:
    for measure in protocol.CATALOG.values():
        assert measure.family.startswith("quantwatch_layer_" if measure.scope == "layer" else "quantwatch_run_")
        assert not measure.family.endswith(("_count", "_total", "_sum", "_bucket")), measure.family
        if measure.name.endswith("_rel_l2"):
            assert measure.is_ratio
            assert measure.family.endswith("_ratio")
    assert {"output_cosine", "update_cosine", "output_sqnr_db"} <= protocol.LOWER_IS_WORSE
    assert set(protocol.LAYER_METRICS).isdisjoint(protocol.SCALARS)


def test_kernels_name_the_formats_the_protocol_names() -> None:
    from quantwatch.kernels.formats import FORMATS, PRESETS

    assert set(FORMATS) <= set(protocol.ELEMENT_FORMATS)
    assert set(PRESETS) == set(protocol.PRESETS)
    for name, spec in FORMATS.items():
        assert protocol.format_bits(name) == spec.bits, name


@pytest.mark.parametrize("value", ["fp8_e4m3:tensor", "nvfp4", "int4:group32", "fp8_e5m2:row", "high_precision"])
def test_layer_formats_accepted(value: str) -> None:
    assert protocol.check_layer_format(value) == value


@pytest.mark.parametrize(
    ("value", "why"), [("fp9", "unknown format"), ("fp8_e4m3:diagonal", "unknown scaling"), ("", "1..")]
)
def test_layer_formats_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        protocol.check_layer_format(value)


def test_one_retry_rule_waits_the_larger_of_backoff_and_retry_after() -> None:
    backoff = protocol.Backoff(initial_seconds=1.0, max_seconds=8.0)
    rng = random.Random(3)
    for failures, base in enumerate([1.0, 2.0, 4.0, 8.0, 8.0], start=1):
        waits = [backoff.wait_seconds(failures, rng) for _ in range(20)]
        assert all(0.5 * base <= w <= base for w in waits)
    assert backoff.wait_seconds(1, rng, retry_after=30.0) == 30.0
    assert backoff.wait_seconds(4, rng, retry_after=0.1) >= 4.0
    assert [s for s in (200, 400, 404, 408, 425, 429, 500, 503) if protocol.is_transient_status(s)] == [
        408,
        425,
        429,
        500,
        503,
    ]
    assert protocol.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480.0 - 60) == pytest.approx(60.0)
    with pytest.raises(ValueError, match="initial_seconds"):
        protocol.Backoff(initial_seconds=2.0, max_seconds=1.0)


def test_the_protocol_imports_neither_torch_nor_fastapi() -> None:
    code = textwrap.dedent(
        """
        import sys
        import quantwatch.protocol
        print(json.dumps(sorted(m for m in ("torch", "fastapi", "starlette", "pydantic") if m in sys.modules)))
        """
    )
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
