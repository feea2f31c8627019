"""The fold worker's encoding process (issue 21): chunk encodings run here, on a core of their own.

The collector's Python threads share one interpreter lock, and ingest keeps it busy: an encoding on the fold worker's
thread slows ingest down by about what it costs, while a process of its own runs beside it. :class:`EncoderProcess`
starts a Python running :func:`serve` (this package first on its path) and sends it the rows to encode through a
pipe, pickled; the process answers with :func:`.folding.encode_chunks` of them and ends when the pipe closes (its
parent ended or closed it). A plain child process, not ``multiprocessing``: that would import the
parent's main module again in the child, which a script without a ``__main__`` guard cannot survive.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

import quantwatch
from quantwatch.service.store.folding import encode_chunks
from quantwatch.service.store.raw_points import Rows

_ROOT = str(Path(quantwatch.__file__).resolve().parent.parent)
_SERVE = f"import sys; from {__name__} import serve; serve(sys.stdin.buffer, sys.stdout.buffer)"


class EncoderProcess:
    """One encoding process and its pipes; :meth:`encode` from one thread at a time."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        pipe = subprocess.PIPE
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=pipe, stdout=pipe, env=env)
        self._requests: IO[bytes] = self._proc.stdin  # type: ignore[assignment]  # both set: PIPE
        self._answers: IO[bytes] = self._proc.stdout  # type: ignore[assignment]

    def encode(self, parts: list[Rows]) -> list[dict[str, object]]:
        """:func:`.folding.encode_chunks` of ``parts``, run in the process (raises EOFError or OSError when it died)."""
        pickle.dump(parts, self._requests, protocol=pickle.HIGHEST_PROTOCOL)
        self._requests.flush()
        chunks: list[dict[str, object]] = pickle.load(self._answers)
        return chunks

    def close(self) -> None:
        """Close the pipe (the process ends) and wait for the process."""
        with suppress(OSError):  # it died: the pipe is broken
            self._requests.close()
        self._answers.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def serve(source: IO[bytes], sink: IO[bytes]) -> None:
    """Answer each pickled list of rows read from ``source`` with its encoded chunks on ``sink``, until EOF."""
    while True:
        try:
            parts: Any = pickle.load(source)
        except EOFError:
            return
        pickle.dump(encode_chunks(parts), sink, protocol=pickle.HIGHEST_PROTOCOL)
        sink.flush()
