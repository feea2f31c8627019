"""Rule and receiver validation, the rules file with line numbers, payloads and Standard Webhooks signatures."""

from __future__ import annotations

import base64
import json
import math
import os
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError
from typer.testing import CliRunner

from quantwatch.cli import app
from quantwatch.service.alerts.rules import (
    DEFAULT_RULES,
    ReceiverSpec,
    Rule,
    RulesFileError,
    ScalarExpression,
    parse_rules_text,
)
from quantwatch.service.alerts.webhooks import Notification, alertmanager_body, signature_headers, webhook_body


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def error_locs(exc: ValidationError) -> list[tuple[object, ...]]:
    return [tuple(error["loc"]) for error in exc.errors()]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"metric": "output_rel_l3"}, "metric"),
        ({"op": "=>"}, "op"),
        ({"consecutive": -1}, "consecutive"),
        ({"consecutive": 0}, "consecutive"),
        ({"keep_firing_for": -2}, "keep_firing_for"),
        ({"layers": "blocks.[0"}, "layers"),
        ({"layers": []}, "layers"),
        ({"layers": ["head", "blocks.[0"]}, "layers"),
        ({"runs": ""}, "runs"),
        ({"annotations": {"summary": "${nope} broke"}}, "annotations"),
        ({"annotations": {"summary": "cost $5"}}, "annotations"),
        ({"threshold": math.nan}, "threshold"),
        ({"labels": {"alertname": "x"}}, "labels"),
        ({"severity": "meh"}, "severity"),
    ],
)
def test_invalid_rule_names_the_field(change: dict[str, object], field: str) -> None:
    base = {"name": "r", "metric": "output_rel_l2", "op": ">", "threshold": 0.05}
    with pytest.raises(ValidationError) as info:
        Rule.model_validate({**base, **change})
    assert any(loc[0] == field for loc in error_locs(info.value))


def test_layers_takes_one_glob_or_a_list_of_which_any_may_match() -> None:
    base = {"name": "r", "metric": "output_rel_l2", "op": ">", "threshold": 0.05}
    single = Rule.model_validate({**base, "layers": "*.attn.*"})
    listed = Rule.model_validate({**base, "layers": ["*.attn.*", "head"]})
    names = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "head", "heads.0"]
    assert [single.matches_layer(n) for n in names] == [True, False, False, False]
    assert [listed.matches_layer(n) for n in names] == [True, False, True, False]
    with pytest.raises(ValidationError, match="a scalar rule watches the whole run"):
        Rule.model_validate({"name": "s", "scalar": "loss", "op": ">", "threshold": 1, "layers": ["*"]})


def test_rule_kind_and_expressions() -> None:
    with pytest.raises(ValidationError, match="exactly one of"):
        Rule(name="r", op=">", threshold=1.0)
    # Any scalar a run may send can be watched (issue 22): a custom one, the agent's counters.
    custom = Rule(name="r", scalar="grad_norm / loss", op=">", threshold=1.0)
    assert custom.expression().names == {"grad_norm", "loss"}
    assert custom.warnings() == ["r: scalar 'grad_norm' is not catalogued; the rule waits for runs to send it"]
    assert Rule(name="c", scalar="agent_dropped_batches", op=">", threshold=0.0).warnings() == []
    percent = Rule(name="p", metric="output_rel_l2", op=">", threshold=5)
    assert percent.warnings() == [
        "p: threshold 5 on the ratio output_rel_l2 looks like a percentage; ratios are stored as ratios (5% is 0.05)"
    ]
    assert Rule(name="q", metric="output_sqnr_db", op="<", threshold=20).warnings() == []
    with pytest.raises(ValidationError, match="not allowed"):
        Rule(name="r", scalar="__import__('os').system('x')", op=">", threshold=1.0)
    with pytest.raises(ValidationError, match="only \\+ - \\* /"):
        Rule(name="r", scalar="loss ** 2", op=">", threshold=1.0)
    expression = ScalarExpression.parse("-(loss - 2 * loss_shadow) / 4")
    assert expression.evaluate({"loss": 1.0, "loss_shadow": 2.5}) == pytest.approx(1.0)
    assert expression.evaluate({"loss": 1.0}) is None
    assert math.isnan(ScalarExpression.parse("loss / loss_shadow").evaluate({"loss": 0.0, "loss_shadow": 0.0}) or 0)


def test_defaults_are_the_shipped_seven() -> None:
    # Issue 15: the update rules, output deviation by number format, non-finite values and the loss as before;
    # issue 17: replicas whose weights differ.
    by_name = {r.name: (r.metric or r.scalar, r.op, r.threshold, r.consecutive) for r in DEFAULT_RULES}
    assert by_name == {
        "quantwatch_output_deviation": ("output_rel_l2", ">", 0.05, 3),
        "quantwatch_output_deviation_low_bit": ("output_rel_l2", ">", 0.05, 3),
        "quantwatch_update_direction": ("update_cosine", "<", 0.95, 3),
        "quantwatch_update_noise": ("update_rel_l2", ">", 0.5774, 3),
        "quantwatch_nonfinite": ("nonfinite_count", ">", 0.0, 1),
        "quantwatch_rank_weight_mismatch": ("rank_weight_mismatch", ">", 0.0, 1),
        "quantwatch_loss_divergence": ("loss / loss_shadow - 1", ">", 0.05, 3),
    }
    shipped = {r.name: r for r in DEFAULT_RULES}
    assert shipped["quantwatch_update_direction"].keep_firing_for == 9  # resolves after 10 steps back at >= 0.95
    assert "2505.19115" in shipped["quantwatch_update_noise"].annotations["description"]
    low_bit = shipped["quantwatch_output_deviation_low_bit"]
    assert low_bit.baseline is not None
    assert (low_bit.baseline.samples, low_bit.baseline.factor) == (5, 2.0)
    # Every layer is held to exactly one output-deviation bound: 8-bit and unknown formats to 5%, low-bit to its own.
    fixed = shipped["quantwatch_output_deviation"]
    for formats, low in [
        ({"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}, False),
        ({"weight": "mxfp8", "input": "mxfp8"}, False),
        ({"weight": "int8:channel", "input": "int8:row"}, False),
        ({"weight": "nvfp4", "input": "nvfp4", "grad": "fp8_e5m2:tensor"}, True),
        ({"weight": "mxfp4", "input": "mxfp6"}, True),
        ({"weight": "int4:group32", "input": "high_precision"}, True),
        ({"weight": "fp6_e3m2:block", "input": "fp6_e3m2:block"}, True),
        (None, False),
    ]:
        assert fixed.matches_layer("l", formats) is not low, formats
        assert low_bit.matches_layer("l", formats) is low, formats


def test_rules_file_errors_carry_line_numbers() -> None:
    text = """\
receivers:
  - name: ops
    url: ftp://example.org/hook
rules:
  - name: ok
    metric: output_rel_l2
    op: ">"
    threshold: 0.05
  - name: bad
    metric: output_rel_l2
    op: ">"
    threshold: 0.05
    consecutive: -1
    layers: "a[b"
"""
    with pytest.raises(RulesFileError) as info:
        parse_rules_text(text, source="rules.yml")
    problems = {where: line for line, where, _ in info.value.problems}
    assert problems == {"receivers[0].url": 3, "rules[1].consecutive": 13, "rules[1].layers": 14}
    assert "rules.yml:13: rules[1].consecutive" in str(info.value)


def test_rules_file_unknown_receiver_and_yaml_error() -> None:
    with pytest.raises(RulesFileError) as info:
        parse_rules_text(
            "rules:\n  - name: a\n    metric: amax\n    op: '>'\n    threshold: 1\n    receivers: [nope]\n"
        )
    assert info.value.problems[0][:2] == (6, "rules[0].receivers[0]")
    with pytest.raises(RulesFileError) as info:
        parse_rules_text("rules:\n  - name: [unclosed\n")
    assert info.value.problems[0][0] == 3


def test_rules_file_defaults_and_overrides() -> None:
    parsed = parse_rules_text(
        "rules:\n  - name: quantwatch_nonfinite\n    metric: nonfinite_count\n    op: '>'\n    threshold: 0\n"
        "    enabled: false\n"
    )
    effective = {rule.name: rule.enabled for rule in parsed.effective_rules()}
    assert effective == {
        "quantwatch_output_deviation": True,
        "quantwatch_output_deviation_low_bit": True,
        "quantwatch_update_direction": True,
        "quantwatch_update_noise": True,
        "quantwatch_loss_divergence": True,
        "quantwatch_rank_weight_mismatch": True,
        "quantwatch_nonfinite": False,
    }
    assert parse_rules_text("default_rules: false\n").effective_rules() == []


def test_receiver_validation_never_echoes_secrets() -> None:
    with pytest.raises(ValidationError) as info:
        ReceiverSpec(name="r", url="file:///etc/passwd")
    assert error_locs(info.value)[0][0] == "url"
    bad = "whsec_" + "A" * 8
    with pytest.raises(ValidationError) as info:
        ReceiverSpec.model_validate({"name": "r", "url": "http://127.0.0.1/h", "secret": bad})
    assert bad not in json.dumps(info.value.errors(include_input=False), default=str)
    good = new_secret()
    receiver = ReceiverSpec.model_validate({"name": "r", "url": "http://127.0.0.1/h", "secret": good})
    assert good not in repr(receiver)
    assert good not in receiver.model_dump_json()
    with pytest.raises(ValidationError, match="set by QuantWatch"):
        ReceiverSpec(name="r", url="http://127.0.0.1/h", headers={"webhook-id": "x"})


def notification(status: str = "firing") -> Notification:
    return Notification(
        status=status,  # type: ignore[arg-type]
        rule=DEFAULT_RULES[0],
        run="gpt-fp4",
        layer="blocks.0.attn.qkv",
        ranks=[0, 3],
        step=120,
        value=math.nan,
        starts_at=1764467200.25,
        ends_at=None if status == "firing" else 1764467300.5,
        episode_id=7,
        external_url="http://127.0.0.1:8000",
    )


def test_webhook_body_is_alertmanager_v4_plus_quantwatch() -> None:
    body = webhook_body(notification(), "ops")
    assert body["version"] == "4"
    assert body["status"] == "firing"
    assert body["receiver"] == "ops"
    alert = body["alerts"][0]
    assert alert["labels"]["alertname"] == "quantwatch_output_deviation"
    assert alert["startsAt"] == "2025-11-30T01:46:40.250Z"
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert "ranks 0,3" in alert["annotations"]["description"]
    assert alert["generatorURL"].startswith("http://127.0.0.1:8000/api/v1/runs/gpt-fp4/series?")
    assert body["quantwatch"]["value"] == "nan"
    assert body["quantwatch"]["ranks"] == [0, 3]
    json.dumps(body, allow_nan=False)
    resolved = alertmanager_body(notification("resolved"), 1764467400.0)[0]
    assert resolved["endsAt"] == "2025-11-30T01:48:20.500Z"
    assert alert["fingerprint"] == webhook_body(notification("resolved"), "x")["alerts"][0]["fingerprint"]


def test_signatures_verify_with_standardwebhooks_during_rotation() -> None:
    old, new = new_secret(), new_secret()
    keys = ReceiverSpec.model_validate({"name": "r", "url": "http://h/", "secrets": [old, new]}).secret_keys()
    body = json.dumps(webhook_body(notification(), "ops")).encode()
    headers = signature_headers(keys, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", int(time.time()), body)
    assert headers["webhook-signature"].count("v1,") == 2
    for secret in (old, new):
        assert Webhook(secret).verify(body, headers)["version"] == "4"
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(old).verify(body + b" ", headers)


def test_rules_check_cli_prints_lines(tmp_path: Path) -> None:
    bad = tmp_path / "rules.yml"
    bad.write_text("rules:\n  - name: x\n    metric: output_rel_l2\n    op: '=>'\n    threshold: 0.05\n")
    result = CliRunner().invoke(app, ["rules", "check", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:4: rules[0].op:" in result.output
    good = tmp_path / "ok.yml"
    good.write_text("default_rules: false\nrules:\n  - {name: x, metric: amax, op: '>', threshold: 1}\n")
    result = CliRunner().invoke(app, ["rules", "check", str(good)])
    assert result.exit_code == 0, result.output
    assert "1 enabled in effect" in result.output
    assert CliRunner().invoke(app, ["rules", "check", str(tmp_path / "missing.yml")]).exit_code == 2
    odd = tmp_path / "odd.yml"
    odd.write_text(
        "default_rules: false\nrules:\n  - {name: pct, metric: output_rel_l2, op: '>', threshold: 5}\n"
        "  - {name: custom, scalar: grad_norm, op: '>', threshold: 10}\n"
    )
    result = CliRunner().invoke(app, ["rules", "check", str(odd)])
    assert result.exit_code == 0, result.output
    assert f"{odd}: warning: pct: threshold 5 on the ratio output_rel_l2 looks like a percentage" in result.output
    assert f"{odd}: warning: custom: scalar 'grad_norm' is not catalogued" in result.output


def test_serve_refuses_a_bad_rules_file_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "rules.yml"
    bad.write_text(
        "rules:\n  - name: x\n    metric: output_rel_l2\n    op: '>'\n    threshold: 0.05\n    consecutive: 0\n"
    )
    result = CliRunner().invoke(
        app, ["serve", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/q.db", "--rules", str(bad)]
    )
    assert result.exit_code == 2
    assert f"{bad}:6: rules[0].consecutive:" in result.output


def test_readme_shows_the_shipped_rules_table() -> None:
    from pathlib import Path

    from quantwatch.service.alerts.defaults import shipped_rules_table

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert shipped_rules_table() in readme
