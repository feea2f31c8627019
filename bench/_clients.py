"""The ingest benchmark's clients: one light process per rank, and what the machine's CPU went to meanwhile.

Each client is this file run as a script (stdlib and msgpack only: no numpy, no httpx, no quantwatch import), so 64 of
them on a 2-core machine cost little beside the collector. It reads its workload from stdin (a length-prefixed msgpack
map: the metric blobs are made once, by the parent), opens one keep-alive HTTP/1.1 connection, sends its warm-up
steps in one request, says ``ready`` and waits for the common start time; then it posts its batches closed loop (back
to back) or at a fixed cadence (one request every ``interval`` seconds from a random phase, as an agent's flush timer
does), until ``seconds`` have passed, and answers on stdout with its points, latencies and its own CPU time over that
window.
"""

from __future__ import annotations

import http.client
import os
import random
import re
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgpack

HEADERS = {"Content-Type": "application/msgpack"}
POINTS = re.compile(rb'"points":(\d+)')


def batch_body(work: dict[str, Any], first_step: int) -> bytes:
    """One request body in the agent's binary encoding: ``steps_per_batch`` steps ``stride`` apart from
    ``first_step``, metric ``j`` of step ``s`` the blob ``(j + s) % len(blobs)`` (a float32 ``bin`` per metric), and
    each of the work's ``scalars`` (if any) a value of its own per step, as the agent's sampled steps carry theirs."""
    blobs, metrics, scalars = work["blobs"], work["metrics"], work.get("scalars", ())
    steps = range(first_step, first_step + work["steps_per_batch"] * work["stride"], work["stride"])
    doc = {
        "run": work["run"],
        "rank": work["rank"],
        "batch_id": uuid.uuid4().hex,
        "layers": work["layers"],
        "steps": [
            {
                "step": s,
                "time": 1.7e9 + s,
                "metrics": {m: blobs[(j + s) % len(blobs)] for j, m in enumerate(metrics)},
                **({"scalars": {name: 1.0 + i + s / 1e6 for i, name in enumerate(scalars)}} if scalars else {}),
            }
            for s in steps
        ],
    }
    return bytes(msgpack.packb(doc, use_bin_type=True))


def send(conn: http.client.HTTPConnection, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request("POST", "/api/v1/ingest", body=body, headers=HEADERS)
    response = conn.getresponse()
    return response, response.read()


def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, int]:
    """POST one batch, retrying after ``Retry-After`` on 429 as the agent does: (points stored, 429s)."""
    refused = 0
    while True:
        try:
            response, answer = send(conn, body)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            conn.close()  # the server ended an idle keep-alive connection: open another, as the agent's client does
            response, answer = send(conn, body)
        if response.status == 429:
            refused += 1
            time.sleep(float(response.getheader("Retry-After") or 1))
            continue
        if response.status != 200:
            raise RuntimeError(f"ingest answered {response.status}: {answer[:300]!r}")
        match = POINTS.search(answer)
        if match is None:
            raise RuntimeError(f"ingest answer without points: {answer[:300]!r}")
        return int(match.group(1)), refused


def client(work: dict[str, Any]) -> dict[str, Any]:
    """Run one rank's requests from the start time the parent sends; its figures."""
    target = urlsplit(work["url"])
    conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=300)
    conn.connect()
    per_request = work["steps_per_batch"] * work["stride"]
    if work["warmup"]:  # before the common start, in one request: the run's episodes open here, not in the window
        post(conn, batch_body({**work, "steps_per_batch": work["warmup"] * work["steps_per_batch"]}, 0))
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    (start,) = struct.unpack("<d", sys.stdin.buffer.read(8))
    conn.close()  # idle while the others warmed up: the server may have closed it (uvicorn keeps one 5 s)
    conn.connect()
    interval, end = work["interval"], start + work["seconds"]
    phase = random.Random(work["rank"]).random() * interval
    time.sleep(max(0.0, start - time.monotonic()))
    cpu = os.times()
    latencies: list[float] = []
    points = refused = late = 0
    lag = 0.0
    for i in range(10**9):
        due = start + phase + i * interval
        if (due if interval > 0 else time.monotonic()) >= end:
            break
        if interval > 0:
            wait = due - time.monotonic()
            time.sleep(max(0.0, wait))
            late += wait < -interval  # sent more than one period after it was due: not keeping up
            lag = max(lag, -wait)
        body = batch_body(work, (work["warmup"] + i) * per_request)
        t0 = time.monotonic()
        stored, retried = post(conn, body)
        latencies.append(time.monotonic() - t0)
        points += stored
        refused += retried
    finished = time.monotonic()
    used = os.times()
    conn.close()
    return {
        "points": points,
        "latencies": latencies,
        "start": start,
        "end": finished,
        "cpu": used.user - cpu.user + used.system - cpu.system,
        "refused": refused,
        "late": late,
        "lag": lag,
    }


def run_clients(
    urls: list[str], works: list[dict[str, Any]], seconds: float, warmup: int, collectors: list[int]
) -> dict[str, Any]:
    """One process per rank's ``works`` entry, rank r posting to ``urls[r % len(urls)]``, each first ``warmup``
    batches' steps in one request, then all started together for ``seconds``: their totals, with the CPU that the
    ``collectors`` (pids), the clients, PostgreSQL and the whole machine used meanwhile."""
    spawned = time.monotonic()
    procs = []
    for work in works:
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None
        config = msgpack.packb({**work, "url": urls[work["rank"] % len(urls)], "seconds": seconds, "warmup": warmup})
        proc.stdin.write(struct.pack("<I", len(config)) + config)
        proc.stdin.flush()
        procs.append(proc)
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"client exited with {proc.wait()} before it was ready")
    start = time.monotonic() + 0.2
    machine, others, collector = machine_busy_seconds(), postgres_cpu_seconds(), collectors_cpu_seconds(collectors)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(struct.pack("<d", start))
        proc.stdin.close()
    results = []
    for proc in procs:
        assert proc.stdout is not None
        out = proc.stdout.read()
        if proc.wait() != 0:
            raise RuntimeError(f"client exited with {proc.returncode}")
        results.append(msgpack.unpackb(out))
    collector = collectors_cpu_seconds(collectors) - collector
    busy = machine_busy_seconds() - machine
    postgres = sum(seconds - others.get(pid, 0.0) for pid, seconds in postgres_cpu_seconds().items())
    span = time.monotonic() - start + 0.2  # what the machine-wide counters covered
    latencies = sorted(x for r in results for x in r["latencies"])
    wall = max(r["end"] for r in results) - start
    return {
        "points": sum(r["points"] for r in results),
        "points_per_second": sum(r["points"] for r in results) / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "requests": len(latencies),
        "wall_seconds": wall,
        "refused": sum(r["refused"] for r in results),
        "late": sum(r["late"] for r in results),
        "lag_seconds": max(r["lag"] for r in results),
        "setup_seconds": start - spawned,
        "cpu_ms_per_request": collector * 1e3 / len(latencies),
        "collector_cores": collector / span,
        "client_cores": sum(r["cpu"] for r in results) / wall,
        "postgres_cores": postgres / span,
        "machine_cores": busy / span,
    }


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc): the collector's cost, which the load of
    other jobs on the machine moves far less than its throughput."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def collectors_cpu_seconds(pids: list[int]) -> float:
    return sum(map(process_cpu_seconds, pids))


def postgres_cpu_seconds() -> dict[int, float]:
    """CPU time so far of each PostgreSQL server process on this machine (its backends do the database's share)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().split(" ", 2)[1] == "(postgres)":
                out[int(stat.parent.name)] = process_cpu_seconds(int(stat.parent.name))
        except (OSError, IndexError):
            continue  # gone meanwhile
    return out


def machine_busy_seconds() -> float:
    """CPU seconds all cores of the machine spent busy so far (/proc/stat: everything but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    (size,) = struct.unpack("<I", sys.stdin.buffer.read(4))
    figures = client(msgpack.unpackb(sys.stdin.buffer.read(size)))
    sys.stdout.buffer.write(msgpack.packb(figures))
