"""A bounded on-disk spool of encoded batches, replayed oldest first.

Each batch is one file whose name orders it (nanosecond time, pid, counter) and records how to send it again
(points, encoding, gzip).  Files are written to a temporary name and renamed, so a crash never leaves half an entry.
When the spool exceeds ``max_bytes`` the oldest entries are deleted and counted.  A later process that opens the same
directory (same run and rank) finds the entries and replays them; a batch replayed twice is harmless because the
collector deduplicates on ``batch_id``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from quantwatch.agent.wire import EncodedBatch

__all__ = ["DiskSpool", "SpoolEntry", "spool_directories"]

_SUFFIX = ".qwb"
_ENCODING_BY_TAG = {"m": "application/msgpack", "j": "application/json"}
_TAG_BY_ENCODING = {v: k for k, v in _ENCODING_BY_TAG.items()}


@dataclass(frozen=True)
class SpoolEntry:
    """One spooled batch: its file and the batch as it will be sent again."""

    path: Path
    batch: EncodedBatch


def _entry_name(batch: EncodedBatch, counter: int) -> str:
    tag = _TAG_BY_ENCODING[batch.content_type] + ("z" if batch.gzip else "")
    return f"{time.time_ns():020d}-{os.getpid():08d}-{counter:08d}-{batch.points}-{tag}{_SUFFIX}"


def _parse_name(name: str) -> tuple[int, str, bool] | None:
    parts = name[: -len(_SUFFIX)].split("-")
    if len(parts) != 5 or not parts[3].isdigit() or not parts[4] or parts[4][0] not in _ENCODING_BY_TAG:
        return None
    return int(parts[3]), _ENCODING_BY_TAG[parts[4][0]], parts[4].endswith("z")


def spool_directories(root: str | os.PathLike[str]) -> list[Path]:
    """``root`` and every directory below it that holds spooled entries, sorted (a job's spool lives in
    ``<spool_dir>/<run>-<digest>/rank-<n>``, so a whole spool folder can be replayed at once)."""
    return sorted({path.parent for path in Path(root).rglob(f"*{_SUFFIX}") if _parse_name(path.name) is not None})


class DiskSpool:
    """Bounded FIFO of encoded batches in ``directory`` (created if missing), at most ``max_bytes`` on disk."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._counter = itertools.count()
        self._names: deque[str] = deque()
        self._sizes: dict[str, int] = {}
        self._total_bytes = 0
        self.dropped_batches = 0
        self.dropped_points = 0
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            if _parse_name(path.name) is None:
                continue
            self._names.append(path.name)
            self._sizes[path.name] = path.stat().st_size
            self._total_bytes += self._sizes[path.name]
        for stale in self.directory.glob("*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()

    def __len__(self) -> int:
        return len(self._names)

    @property
    def size_bytes(self) -> int:
        """Bytes the spooled entries occupy."""
        return self._total_bytes

    def append(self, batch: EncodedBatch) -> None:
        """Write ``batch`` as the newest entry, then drop the oldest entries while over the size cap."""
        name = _entry_name(batch, next(self._counter))
        tmp = self.directory / (name + ".tmp")
        tmp.write_bytes(batch.body)
        tmp.rename(self.directory / name)
        self._names.append(name)
        self._sizes[name] = len(batch.body)
        self._total_bytes += len(batch.body)
        while len(self._names) > 1 and self.size_bytes > self.max_bytes:
            oldest = self._names[0]
            parsed = _parse_name(oldest)
            self._discard(oldest)
            self.dropped_batches += 1
            self.dropped_points += parsed[0] if parsed else 0

    def oldest(self) -> SpoolEntry | None:
        """The oldest entry on disk, or None when empty (entries another process already took are skipped)."""
        while self._names:
            name = self._names[0]
            parsed = _parse_name(name)
            path = self.directory / name
            try:
                body = path.read_bytes()
            except FileNotFoundError:
                self._discard(name)
                continue
            if parsed is None:
                self._discard(name)
                continue
            points, content_type, gzipped = parsed
            return SpoolEntry(path, EncodedBatch(name, body, content_type, gzipped, points))
        return None

    def remove(self, entry: SpoolEntry) -> None:
        """Delete ``entry`` once it was delivered (or found undeliverable)."""
        self._discard(entry.path.name)

    def _discard(self, name: str) -> None:
        with contextlib.suppress(ValueError):
            self._names.remove(name)
        self._total_bytes -= self._sizes.pop(name, 0)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()
