"""The wire encoder against an independent decoder (conftest.decode_body) and the byte layout of the contract."""

from __future__ import annotations

import gzip
import json
import math

import msgpack
import numpy as np
import pytest

from quantwatch.agent.wire import Batch, StepRecord, encode_batch

LAYERS = ("blocks.0.attn.qkv", "blocks.0.mlp.fc1")


def _batch() -> Batch:
    steps = (
        StepRecord(
            step=120,
            time=1764467200.25,
            metrics={"output_rel_l2": [0.031, 0.062], "underflow_ratio": [0.001, None]},
            scalars={"loss": 2.71},
        ),
        StepRecord(
            step=130,
            time=1764467201.5,
            metrics={"output_rel_l2": [float("nan"), float("inf")], "amax": [float("-inf"), 3.0]},
            scalars={"loss": float("nan")},
        ),
    )
    return Batch("gpt-fp4", 0, "6f1c", LAYERS, steps)


def test_json_carries_nulls_and_non_finite_as_strings() -> None:
    encoded = encode_batch(_batch(), "json", compress=False)
    assert encoded.headers() == {"Content-Type": "application/json"}
    doc = json.loads(encoded.body)
    assert doc["run"] == "gpt-fp4"
    assert doc["rank"] == 0
    assert doc["batch_id"] == "6f1c"
    assert doc["layers"] == list(LAYERS)
    assert doc["steps"][0] == {
        "step": 120,
        "time": 1764467200.25,
        "metrics": {"output_rel_l2": [0.031, 0.062], "underflow_ratio": [0.001, None]},
        "scalars": {"loss": 2.71},
    }
    assert doc["steps"][1]["metrics"] == {"output_rel_l2": ["nan", "inf"], "amax": ["-inf", 3.0]}
    assert doc["steps"][1]["scalars"] == {"loss": "nan"}


def test_msgpack_uses_float32_bin_only_when_every_layer_has_a_value() -> None:
    encoded = encode_batch(_batch(), "msgpack", compress=False)
    assert encoded.content_type == "application/msgpack"
    doc = msgpack.unpackb(encoded.body, raw=False)
    first, second = doc["steps"]
    rel = first["metrics"]["output_rel_l2"]
    assert isinstance(rel, bytes)
    assert rel == np.array([0.031, 0.062], dtype="<f4").tobytes()
    assert first["metrics"]["underflow_ratio"] == [pytest.approx(0.001), None]
    values = np.frombuffer(second["metrics"]["output_rel_l2"], dtype="<f4")
    assert math.isnan(values[0])
    assert values[1] == np.inf
    assert np.frombuffer(second["metrics"]["amax"], dtype="<f4").tolist() == [-np.inf, 3.0]
    assert math.isnan(second["scalars"]["loss"])
    assert first["scalars"] == {"loss": 2.71}


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_gzip_wraps_the_same_document(encoding: str) -> None:
    plain = encode_batch(_batch(), encoding, compress=False)  # type: ignore[arg-type]
    zipped = encode_batch(_batch(), encoding, compress=True)  # type: ignore[arg-type]
    assert zipped.headers()["Content-Encoding"] == "gzip"
    assert gzip.decompress(zipped.body) == plain.body


def test_point_count_counts_measured_values_and_scalars() -> None:
    # step 120: 2 + 1 metric values and 1 scalar; step 130: 4 values and 1 scalar.
    assert _batch().point_count() == 4 + 5
    assert encode_batch(_batch()).points == 9
