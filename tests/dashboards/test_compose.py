"""docker-compose.yml without a Docker engine: valid against the Compose JSON schema, every mounted path and build
input exists in the repository, health-gated dependencies, and no secrets in the file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMA = Path(__file__).parent / "data" / "compose-spec.schema.json"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return data


def test_compose_file_validates_against_the_compose_schema(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert errors == [], [f"{list(e.path)}: {e.message}" for e in errors]


def test_the_schema_check_catches_a_broken_file(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    broken = json.loads(json.dumps(compose))
    broken["services"]["collector"]["depends_on"]["postgres"]["condition"] = "service_sleepy"
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_the_stack_has_every_part(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"postgres", "collector", "prometheus", "alertmanager", "grafana"}
    assert "yesoreyeram-infinity-datasource" in compose["services"]["grafana"]["environment"]["GF_INSTALL_PLUGINS"]


def test_every_bind_mount_exists_in_the_repository(compose: dict[str, Any]) -> None:
    binds = []
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith((".", "/")):
                binds.append((name, source))
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} is not declared"
    assert binds
    for name, source in binds:
        assert (REPO / source).resolve().exists(), f"{name} mounts {source}, which does not exist"


def test_the_collector_image_builds_from_files_in_the_repository(compose: dict[str, Any]) -> None:
    build = compose["services"]["collector"]["build"]
    dockerfile = REPO / build["context"] / build["dockerfile"]
    text = dockerfile.read_text()
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources
    for source in sources:
        assert (REPO / build["context"] / source).exists(), f"Dockerfile copies {source}, which does not exist"
    assert "db upgrade" in text  # migrations run before the collector serves


def test_dependencies_wait_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", f"{name} → {dependency}"
            assert "healthcheck" in services[dependency]


def test_no_secrets_in_the_compose_file_and_every_variable_in_env_example(compose: dict[str, Any]) -> None:
    text = (REPO / "docker-compose.yml").read_text()
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", text))
    example = dict(
        line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines() if line and line[0] != "#"
    )
    assert used <= set(example), f"variables missing from .env.example: {sorted(used - set(example))}"
    for service in compose["services"].values():
        environment = service.get("environment", {})
        for key, value in environment.items():
            if re.search(r"PASSWORD|TOKEN|SECRET", key):
                assert str(value).startswith("${"), f"{key} must come from .env, not the compose file"
