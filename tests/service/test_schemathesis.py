"""Property-based requests generated from the OpenAPI schema: whatever a client sends, never a 500."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

TOKENS = {"tok-admin": ["admin"]}


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx: Any, value: Any) -> bytes:
    return bytes(msgpack.packb(_packable(value), use_bin_type=True))


def _packable(value: Any) -> Any:
    # msgpack integers are 64-bit; larger generated integers travel as floats (the server must still cope).
    if isinstance(value, dict):
        return {k: _packable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_packable(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    return value


def test_no_request_gets_a_server_error(make_app: Callable[..., Any]) -> None:
    # The schema is loaded in-process (ASGI) on this test's database, with auth on; every operation gets a bounded
    # number of generated requests (valid and invalid) checked for 5xx, undeclared status codes and content types.
    app = make_app(tokens=TOKENS)
    seed = {"run": "seeded", "batch_id": "seed", "layers": ["a", "b"], "steps": []}
    seed["steps"] = [
        {"step": i, "metrics": {"m": [i * 0.5, "nan"]}, "scalars": {"loss": 1.0 / (i + 1)}} for i in range(300)
    ]
    with TestClient(app) as client:
        assert (
            client.post("/api/v1/ingest", json=seed, headers={"Authorization": "Bearer tok-admin"}).status_code == 200
        )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:

        @given(case=operation.as_strategy(), data=st.data())
        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case: Any, data: st.DataObject) -> None:
            # Half the time aim at the seeded run and its real names so the query code runs, not just the 404s.
            if "run" in (case.path_parameters or {}) and data.draw(st.booleans()):
                case.path_parameters["run"] = "seeded"
                if isinstance(case.query, dict):
                    for key, real in (("metric", "m"), ("layer", "a"), ("scalar", "loss")):
                        if key in case.query and data.draw(st.booleans()):
                            case.query[key] = real
            case.call_and_validate(
                headers={"Authorization": "Bearer tok-admin"},
                checks=[not_a_server_error, status_code_conformance, content_type_conformance],
            )

        check()
