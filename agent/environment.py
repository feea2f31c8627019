"""What a rank says about itself: its data-parallel replica group and its software/device environment.

The replica group is the set of ranks that must hold bit-identical master weights of every layer: all ranks of a
DDP module's process group; under FSDP2/HSDP (parameters are ``DTensor``s on a device mesh) the ranks that hold the
same shard, i.e. the mesh's ranks along every ``Replicate`` dimension at this rank's coordinates on the ``Shard``
ones; otherwise every rank of the world.  ``attach(replica_group=[...])`` overrides it.

The environment (torch, CUDA, NCCL, driver, device and compute capability, quantwatch) is read once.  For tests, env
``QUANTWATCH_ENV_OVERRIDE`` holds a JSON object whose string values replace what was read (``'{"torch": "9.9"}'``),
so two ranks of one machine can claim different versions.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantwatch import __version__
from quantwatch.agent.errors import ConfigError
from quantwatch.protocol import ENVIRONMENT_KEYS, MAX_ENVIRONMENT_VALUE_LENGTH, MAX_RANK, MAX_REPLICA_GROUP

__all__ = ["ENVIRONMENT_OVERRIDE_ENV", "environment", "replica_group"]

ENVIRONMENT_OVERRIDE_ENV = "QUANTWATCH_ENV_OVERRIDE"


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank()), int(torch.distributed.get_world_size())
    world = os.environ.get("WORLD_SIZE", "1")
    return -1, int(world) if world.isdigit() and int(world) > 0 else 1


def _mesh_group(model: nn.Module, rank: int) -> tuple[int, ...] | None:
    """The replicas of this rank's shard when the parameters are DTensors (FSDP2, HSDP), else None."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        placements = getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        ranks = mesh.mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return (rank,)
        index = tuple(
            slice(None) if type(placement).__name__ == "Replicate" else coordinate[dim]
            for dim, placement in enumerate(placements)
        )
        return tuple(sorted(int(r) for r in ranks[index].flatten().tolist()))
    return None


def replica_group(model: nn.Module, rank: int, override: Iterable[int] | None = None) -> tuple[int, ...]:
    """The ranks that must hold the same master weights as ``rank`` (sorted, ``rank`` among them).

    ``override`` (``attach(replica_group=...)``) wins; raises ConfigError when it is not a list of ranks holding
    ``rank``."""
    if override is not None:
        if isinstance(override, str | bytes):
            raise ConfigError("replica_group", f"must be a list of ranks, got {override!r}")
        chosen = list(override)
        if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_RANK for r in chosen):
            raise ConfigError("replica_group", f"must hold integer ranks 0..{MAX_RANK}, got {chosen!r}")
        if rank not in chosen:
            raise ConfigError("replica_group", f"must include this process's rank {rank}, got {chosen!r}")
        if len(set(chosen)) > MAX_REPLICA_GROUP:
            raise ConfigError("replica_group", f"at most {MAX_REPLICA_GROUP} ranks")
        return tuple(sorted(set(chosen)))
    process_group = getattr(model, "process_group", None)
    if isinstance(model, nn.parallel.DistributedDataParallel) and process_group is not None:
        return tuple(sorted(int(r) for r in torch.distributed.get_process_group_ranks(process_group)))
    meshed = _mesh_group(model, rank)
    if meshed is not None:
        return meshed
    _, world = _world()
    return tuple(range(world)) if rank < world else (rank,)


def _driver_version() -> str:
    try:
        line = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""
    words = [w for w in line.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else ""


def _read_environment(device: torch.device) -> dict[str, str]:
    facts = dict.fromkeys(ENVIRONMENT_KEYS, "")
    facts["torch"] = str(torch.__version__)
    facts["quantwatch"] = __version__
    facts["cuda"] = str(torch.version.cuda or "")
    if device.type == "cuda" and torch.cuda.is_available():
        facts["device"] = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        facts["compute_capability"] = f"{major}.{minor}"
        try:
            nccl: Any = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            facts["nccl"] = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)
        except (AttributeError, RuntimeError):
            pass
        facts["driver"] = _driver_version()
    else:
        facts["device"] = platform.processor() or platform.machine() or device.type
    return facts


def _override() -> Mapping[str, str]:
    raw = os.environ.get(ENVIRONMENT_OVERRIDE_ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(ENVIRONMENT_OVERRIDE_ENV, f"must be a JSON object of strings: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(ENVIRONMENT_OVERRIDE_ENV, f"must be a JSON object of strings, got {raw!r}")
    return value


def environment(device: torch.device) -> dict[str, str]:
    """The rank's environment as it is reported (``ENVIRONMENT_KEYS``; ``""`` where one does not apply), with env
    ``QUANTWATCH_ENV_OVERRIDE`` applied. Raises ConfigError for a malformed override."""
    facts = {**_read_environment(device), **_override()}
    return {key: value[:MAX_ENVIRONMENT_VALUE_LENGTH] for key, value in facts.items()}
