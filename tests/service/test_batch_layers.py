"""A batch's layer names: a valid list is taken as it is, and the first bad name is the one the error names.

The decoder checks a whole list with builtins that loop in C and walks it name by name only when that check fails,
so each kind of bad name is tried here at a position after good ones, and after an earlier name of another kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from quantwatch.protocol import wire
from quantwatch.service.batch import batch_from_obj
from quantwatch.service.wire_error import WireError

TOO_LONG = "x" * (wire.MAX_LAYER_NAME_LENGTH + 1)


def _doc(layers: list[Any]) -> dict[str, Any]:
    values = np.arange(len(layers), dtype="<f4").tobytes()
    return {"run": "r", "batch_id": "b", "layers": layers, "steps": [{"step": 0, "metrics": {"m": values}}]}


def test_valid_names_up_to_the_length_limit_are_taken_in_order() -> None:
    layers = ["a", "blocks.0.attn.qkv", "x" * wire.MAX_LAYER_NAME_LENGTH, "ü"]
    batch = batch_from_obj(_doc(layers))
    assert batch.layers == tuple(layers)
    assert batch.steps[0].metrics["m"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("layers", "field", "message"),
    [
        (["a", "b", 7, ""], "layers[2]", "chars"),
        (["a", None], "layers[1]", "chars"),
        (["a", "b", ""], "layers[2]", "chars"),
        (["a", TOO_LONG, "c\x00"], "layers[1]", "chars"),
        (["a", "b\x00c", TOO_LONG], "layers[1]", "NUL"),
        (["a", "b", "c", "\x00"], "layers[3]", "NUL"),
    ],
)
def test_the_first_bad_name_is_the_one_named(layers: list[Any], field: str, message: str) -> None:
    with pytest.raises(WireError) as caught:
        batch_from_obj(_doc(layers))
    assert caught.value.status == 422
    assert caught.value.field == field
    assert message in caught.value.message
