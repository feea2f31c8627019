"""Agent overhead on a small FP8/FP4 transformer trained on CPU, and step times while the collector is down.

Part 1 (overhead): copies of the same model, trained side by side, the variants interleaved round by round so
drift of a shared machine hits all of them alike:

* ``none``        no agent;
* ``defaults``    ``attach(model, run=..., url=...)`` with every default (``every=DEFAULT_EVERY``);
* ``every1``      ``every=1`` and every per-layer metric (all but ``weight_drift_rel_l2``, which needs a full
  shadow model and so a second training step), exact, without what-if statistics (``whatif_every=0``);
* ``every1_whatif`` the same with the what-if statistics on every sampled step (``whatif_every=1``: every layer's
  weight, input and gradient quantized to every candidate, the stochastic-rounding ones included); the agent at its
  defaults with what-if every ``--whatif-periods`` sampled step is composed from these (``defaults_whatif``);
* ``every1_rows`` the same with ``shadow_rows=1/8`` (``output_*`` and ``update_cosine`` estimated from an eighth of
  the rows);
* ``tensorboard`` the same per-layer figures, written through TensorBoard's ``SummaryWriter`` on the training
  thread each step (the usual "compute, .item(), add_scalar" pattern; the agent measures, the writer logs);
* ``ref_gemms``   not a training step: the two FP32 GEMMs an exact sampled step adds for every layer ``attach``
  found (the reference forward ``F.linear(x, W, b)`` and the reference weight gradient ``dYᵀX``, at the layer's
  shapes), timed alongside; its ratio is the floor under ``every1``'s (``every1`` ≥ 1 + ``ref_gemms``).

Each for two families of the same transformer (``--families``): ``quantlinear`` (QuantWatch's ``quantize_model``:
FP8 attention, NVFP4 MLP), ``float8`` (torchao's ``convert_to_float8_training`` with
``Float8LinearConfig(emulate=True)`` on every block's linear layers: FP8 E4M3 tensor-scaled, emulated on the CPU)
and ``int8`` (torchao's INT8 mixed-precision training, ``module_swap=True``: ``torch._int_mm`` on the CPU).
Ratios are to the family's own ``none``.  The agent measures whatever ``attach`` finds in a model: ``Float8Linear``
layers only once the torchao adapter is registered (until then the float8 variants measure nothing, and their ratios
show only the gate and exporter).

Part 2 (outage): ``every=1`` against a real collector (a ``quantwatch.service`` app on uvicorn in a subprocess,
SQLite file); after a normal phase (as long as the outage) the collector is killed for ``--outage-seconds`` and
started again on the same port and database; step-time p99 during the outage vs the normal phase, and points lost
(points the agent produced minus points the collector holds after recovery).

Run: ``.venv/bin/python bench/agent_overhead.py`` (needs the ``bench`` extra for TensorBoard).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import httpx
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import quantwatch.agent as qw
from quantwatch.agent.spool import DiskSpool
from quantwatch.agent.whatif import WHATIF_STEPS, layer_candidates
from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model
from quantwatch.service.server import free_port, wait_until_ready

WIDTH, BLOCKS, HEADS, VOCAB = 256, 4, 4, 512


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (qkv, proj) and a GELU MLP (fc1, fc2)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(WIDTH, 3 * WIDTH), "proj": nn.Linear(WIDTH, WIDTH)})
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(WIDTH, 4 * WIDTH), "fc2": nn.Linear(4 * WIDTH, WIDTH)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.attn["qkv"](self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn["proj"](a.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.ln2(x))))


class TinyLM(nn.Module):
    """4 blocks of width 256 with an FP32 embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> nn.Module:
    """The benchmark model: FP8 (E4M3 weights/activations, E5M2 gradients) attention, NVFP4 MLP."""
    torch.manual_seed(0)
    model = TinyLM()
    fp8 = QuantConfig(weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
    fp4 = QuantConfig(weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4"), grad=QuantSpec("fp8_e5m2"))
    return quantize_model(model, Recipe(rules=[("blocks.*.attn.*", fp8), ("blocks.*.mlp.*", fp4)]))


def make_float8_model() -> nn.Module:
    """The same transformer with torchao's Float8Linear (emulated FP8 GEMMs) for every block's linear layers."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = TinyLM()
    convert_to_float8_training(
        model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda _, fqn: fqn.startswith("blocks.")
    )
    return model


def make_int8_model() -> nn.Module:
    """The same transformer with torchao's INT8 mixed-precision training (``module_swap=True``: torchao 0.18's
    weight-wrapper variant computes in high precision) for every block's linear layers."""
    from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = TinyLM()
    quantize_(
        model,
        Int8MixedPrecisionTrainingConfig(module_swap=True),
        filter_fn=lambda module, fqn: isinstance(module, nn.Linear) and fqn.startswith("blocks."),
    )
    return model


FAMILIES = {"quantlinear": make_model, "float8": make_float8_model, "int8": make_int8_model}


class TensorBoardExporter:
    """Writes every figure with ``SummaryWriter.add_scalar`` (one tag per layer and metric)."""

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)

    def export(self, batch: qw.Batch) -> None:
        """Write the batch's figures."""
        for record in batch.steps:
            for metric, values in record.metrics.items():
                for layer, value in zip(batch.layers, values, strict=True):
                    if value is not None:
                        self.writer.add_scalar(f"{layer}/{metric}", value, record.step)
            for name, value in record.scalars.items():
                self.writer.add_scalar(name, value, record.step)

    def idle(self) -> None:
        """Nothing pending."""

    def shutdown(self) -> None:
        """Nothing to interrupt."""

    def close(self) -> None:
        """Close the event file."""
        self.writer.close()

    def counters(self) -> dict[str, int]:
        """No counters."""
        return {}


class CountingExporter(qw.HttpExporter):
    """The agent's HTTP exporter, counting the points the agent produced."""

    produced_points = 0

    def export(self, batch: qw.Batch) -> None:
        """Count, then export as usual."""
        self.produced_points += batch.point_count()
        super().export(batch)


class Trainer:
    """One model copy with its optimizer, batch source and (optional) monitor."""

    def __init__(self, model: nn.Module, monitor: qw.Monitor | None, batch: int, seq: int, sync_flush: bool) -> None:
        self.model = model
        self.monitor = monitor
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(1)
        self.batch, self.seq = batch, seq
        self.sync_flush = sync_flush
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.sampled: list[bool] = []

    def step(self) -> float:
        """One training step; returns its wall time in seconds."""
        started = time.perf_counter()
        cpu_started = time.process_time()
        tokens = torch.randint(0, VOCAB, (self.batch, self.seq + 1), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sampled = False
        if self.monitor is not None:
            before = self.monitor.stats()["sampled_steps"]
            self.monitor.step(loss=loss, tokens=self.batch * self.seq)
            sampled = self.monitor.stats()["sampled_steps"] > before
            if self.sync_flush:
                self.monitor.flush(60)
        elapsed = time.perf_counter() - started
        self.times.append(elapsed)
        self.cpu_times.append(time.process_time() - cpu_started)
        self.sampled.append(sampled)
        return elapsed


class Timed(Protocol):
    """What the rounds time: a :class:`Trainer` or the :class:`ReferenceGemms`."""

    monitor: qw.Monitor | None
    times: list[float]
    cpu_times: list[float]
    sampled: list[bool]

    def step(self) -> float:
        """One timed step; returns its wall time in seconds."""
        ...


class ReferenceGemms:
    """The FP32 GEMMs an exact sampled step adds per monitored layer, timed like a :class:`Trainer`'s step: for each
    layer, ``F.linear(x, W, b)`` and ``dYᵀX`` on random tensors of its shapes (``tokens`` rows)."""

    monitor: qw.Monitor | None = None

    def __init__(self, model: nn.Module, layers: list[str], tokens: int) -> None:
        gen = torch.Generator().manual_seed(2)
        self.operands = []
        for name in layers:
            weight = model.get_submodule(name).weight
            outputs, inputs = weight.shape
            shapes = ((tokens, inputs), (outputs, inputs), (outputs,), (tokens, outputs))
            self.operands.append(tuple(torch.randn(shape, generator=gen) for shape in shapes))
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.sampled: list[bool] = []

    def step(self) -> float:
        """Both GEMMs of every layer once; returns their wall time in seconds."""
        started, cpu_started = time.perf_counter(), time.process_time()
        for x, w, b, dy in self.operands:
            F.linear(x, w, b)
            dy.t().mm(x)
        elapsed = time.perf_counter() - started
        self.times.append(elapsed)
        self.cpu_times.append(time.process_time() - cpu_started)
        self.sampled.append(False)
        return elapsed


class Collector:
    """A collector (``quantwatch.service`` on uvicorn) in a subprocess, stoppable and restartable."""

    def __init__(self, database: Path, port: int) -> None:
        self.database, self.port = database, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start and wait until it answers."""
        code = (
            "import uvicorn; from quantwatch.service import Settings, create_app; "
            f"uvicorn.run(create_app(Settings(database_url='sqlite:///{self.database}')), host='127.0.0.1', "
            f"port={self.port}, log_level='warning')"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        wait_until_ready(self.proc, f"{self.url}/healthz", 60, "collector")

    def stop(self) -> None:
        """Kill it (an outage, not a graceful drain)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def points(self, run: str) -> int:
        """Points the collector holds for ``run``."""
        runs = {r["name"]: r for r in httpx.get(f"{self.url}/api/v1/runs", timeout=30).json()}
        return int(runs[run]["points"]) if run in runs else 0


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def gate_cost(calls: int = 5000) -> float:
    """Seconds one ``monitor.step()`` costs on an unsampled step (the gate closed; no hook is installed then)."""
    model = make_model()
    monitor = qw.attach(model, run="bench-gate", exporter=qw.InMemoryExporter(), every=10 * calls)
    monitor.step(loss=1.0)  # step 0 is sampled; every later call here is not
    started = time.perf_counter()
    for _ in range(calls):
        monitor.step(loss=1.0)
    per_call = (time.perf_counter() - started) / calls
    monitor.close(10)
    print(f"\n== gate: monitor.step() on an unsampled step costs {per_call * 1e6:.1f} us (mean of {calls} calls) ==")
    return per_call


def candidate_costs(args: argparse.Namespace, repeats: int = 20) -> None:
    """Milliseconds one what-if candidate costs on a gradient of the MLP's fc1 output (tokens x 4 x WIDTH), on the
    path ``auto`` takes (the native kernels on the CPU, stochastic rounding with its draws from ``generator``)."""
    from quantwatch.kernels import quantize
    from quantwatch.protocol import candidate_spec

    x = torch.randn(args.batch * args.seq, 4 * WIDTH)
    generator = torch.Generator().manual_seed(0)
    formats = {"weight": "nvfp4", "input": "nvfp4", "grad": "fp8_e5m2:tensor"}
    print(f"\n== what-if candidates on a {tuple(x.shape)} gradient (median of {repeats} calls after one) ==")
    print(f"{'candidate':<22} {'wall ms':>9} {'CPU ms':>9}")
    for candidate in dict.fromkeys([*layer_candidates(formats)["grad"], "nvfp4+sr"]):
        fmt, scaling, rounding = candidate_spec(candidate)
        quantize(x, fmt, scaling, rounding, generator=generator, with_stats=True)  # a first call builds or loads
        wall, cpu = [], []
        for _ in range(repeats):
            started, started_cpu = time.perf_counter(), time.process_time()
            quantize(x, fmt, scaling, rounding, generator=generator, with_stats=True)
            wall.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
        print(f"{candidate:<22} {1000 * statistics.median(wall):9.3f} {1000 * statistics.median(cpu):9.3f}", flush=True)


def overhead(
    args: argparse.Namespace, collector: Collector, tmp: Path, gate_seconds: float, family: str
) -> dict[str, float]:
    """Part 1: interleaved step times of the variants of one model family; returns median ratios to ``none``."""
    base = FAMILIES[family]()
    every1_metrics = list(qw.DEFAULT_METRICS)
    trainers: dict[str, Timed] = {
        "none": Trainer(copy.deepcopy(base), None, args.batch, args.seq, False),
    }
    model = copy.deepcopy(base)
    trainers["defaults"] = Trainer(
        model,
        qw.attach(model, run=f"bench-{family}-defaults", url=collector.url, spool_dir=tmp / f"{family}-s1"),
        args.batch,
        args.seq,
        False,
    )
    for name, shadow_rows, whatif_every in (("every1", None, 0), ("every1_whatif", None, 1), ("every1_rows", 1 / 8, 0)):
        model = copy.deepcopy(base)
        monitor = qw.attach(
            model,
            run=f"bench-{family}-{name}",
            url=collector.url,
            every=1,
            metrics=every1_metrics,
            shadow_rows=shadow_rows,
            whatif_every=whatif_every,
            spool_dir=tmp / f"{family}-{name}",
        )
        trainers[name] = Trainer(model, monitor, args.batch, args.seq, False)
    model = copy.deepcopy(base)
    monitor = qw.attach(
        model,
        run=f"bench-{family}-tb",
        exporter=TensorBoardExporter(str(tmp / f"{family}-tb")),
        every=1,
        metrics=every1_metrics,
        whatif_every=0,
    )
    trainers["tensorboard"] = Trainer(model, monitor, args.batch, args.seq, True)
    found = trainers["every1"].monitor
    trainers["ref_gemms"] = ReferenceGemms(base, list(found.layers) if found else [], args.batch * args.seq)
    print(
        f"\n== {family}: {len(trainers['every1'].monitor.layers) if trainers['every1'].monitor else 0} layers "
        "found by attach ==",
        flush=True,
    )
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.step()
        trainer.times.clear()
        trainer.cpu_times.clear()
        trainer.sampled.clear()
    names = list(trainers)
    rounds = args.rounds if family == "quantlinear" else args.float8_rounds
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            for _ in range(args.steps_per_round):
                trainers[name].step()
        print(f"{family} round {round_index + 1}/{rounds} done", flush=True)
    # Wall time is what training feels; process CPU time (all threads of this process, the exporter thread
    # included) is far less disturbed by other work on a shared machine, so both are printed.
    ratios: dict[str, float] = {}
    for clock in ("wall", "cpu"):
        series = {name: (t.times if clock == "wall" else t.cpu_times) for name, t in trainers.items()}
        medians = {name: statistics.median(v) for name, v in series.items()}
        print(f"\n== {family} overhead ({clock} time): {rounds} rounds x {args.steps_per_round} steps per variant ==")
        print(f"{'variant':<12} {'median s':>9} {'mean s':>9} {'ratio (median)':>15} {'ratio (mean)':>13}")
        mean_none = statistics.mean(series["none"])
        for name, values in series.items():
            ratios[f"{name}_{clock}"] = medians[name] / medians["none"]
            mean = statistics.mean(values)
            ratio = medians[name] / medians["none"]
            print(f"{name:<12} {medians[name]:9.3f} {mean:9.3f} {ratio:15.3f} {mean / mean_none:13.3f}")
        # At defaults only one step in DEFAULT_EVERY is sampled, too few to time directly in a short run.  Its cost
        # is composed from steps measured side by side: the defaults copy's unsampled steps (gate closed) and the
        # every1 copy's steps (the same default metric set, sampled).
        flags = trainers["defaults"].sampled
        unsampled = [t for t, s in zip(series["defaults"], flags, strict=True) if not s] or series["defaults"]
        every = qw.DEFAULT_EVERY
        composed = ((every - 1) * statistics.median(unsampled) + medians["every1"]) / (every * medians["none"])
        ratios[f"defaults_composed_{clock}"] = composed
        print(
            f"defaults (every={every}) composed: ({every - 1} x unsampled median {statistics.median(unsampled):.3f} s"
            f" + 1 x sampled {medians['every1']:.3f} s) / {every} / none {medians['none']:.3f} s = {composed:.3f}"
        )
        # The same with the unsampled step taken as the unmonitored step plus the measured gate cost: an unsampled
        # step runs no hook (tests/agent/test_monitor.py checks it), so this removes copy-to-copy noise.
        from_gate = ((every - 1) * (medians["none"] + gate_seconds) + medians["every1"]) / (every * medians["none"])
        ratios[f"defaults_from_gate_{clock}"] = from_gate
        print(f"defaults (every={every}) from none + gate: {from_gate:.3f}")
        # With what-if every `period` sampled steps, one sampled step in `period` also measures the what-if
        # statistics (the every1_whatif copy's steps); the rest are the every1 copy's.
        whatif_ms = 1000 * (medians["every1_whatif"] - medians["every1"])
        print(
            f"what-if on a sampled step: +{whatif_ms:.1f} ms ({medians['every1_whatif'] / medians['every1']:.3f} x the"
            f" sampled step, {medians['every1_whatif'] / medians['none']:.3f} x the unmonitored one)"
        )
        for period in args.whatif_periods:
            sampled = ((period - 1) * medians["every1"] + medians["every1_whatif"]) / period
            with_whatif = ((every - 1) * (medians["none"] + gate_seconds) + sampled) / (every * medians["none"])
            ratios[f"defaults_whatif{period}_{clock}"] = with_whatif
            print(f"defaults (every={every}, whatif_every={period}) from none + gate: {with_whatif:.3f}")
    for name, trainer in trainers.items():
        if trainer.monitor is not None:
            trainer.monitor.close(60)
            print(f"{family} {name}: agent stats {trainer.monitor.stats()}")
    return ratios


def steps_for(trainer: Trainer, seconds: float) -> list[float]:
    """Step times of the steps ``trainer`` makes in ``seconds``."""
    times: list[float] = []
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        times.append(trainer.step())
    return times


def outage(args: argparse.Namespace, collector: Collector, tmp: Path) -> None:
    """Part 2: every=1 run with the collector killed for ``args.outage_seconds``; p99 and points lost."""
    model = make_model()
    exporter = CountingExporter(collector.url, spool=DiskSpool(tmp / "outage-spool", 1 << 30))
    monitor = qw.attach(model, run="bench-outage", exporter=exporter, every=1)
    trainer = Trainer(model, monitor, args.batch, args.seq, False)
    for _ in range(args.warmup):
        trainer.step()
    # Each phase lasts as long as the outage, so that the p99s compare tails of as many steps.
    normal = steps_for(trainer, args.outage_seconds)
    collector.stop()
    during = steps_for(trainer, args.outage_seconds)
    spooled = monitor.stats().get("spooled_batches", 0)
    collector.start()
    after = steps_for(trainer, args.outage_seconds)
    closed = monitor.close(120)
    stats = monitor.stats()
    held = collector.points("bench-outage")
    print(f"\n== outage: collector killed for {args.outage_seconds:.0f} s during an every=1 run ==")
    print(f"normal steps {len(normal)}: p50 {percentile(normal, 0.5):.3f} s, p99 {percentile(normal, 0.99):.3f} s")
    print(f"outage steps {len(during)}: p50 {percentile(during, 0.5):.3f} s, p99 {percentile(during, 0.99):.3f} s")
    print(f"after  steps {len(after)}: p50 {percentile(after, 0.5):.3f} s, p99 {percentile(after, 0.99):.3f} s")
    print(f"outage p99 / normal p99: {percentile(during, 0.99) / percentile(normal, 0.99):.3f}")
    print(f"batches spooled during the outage: {spooled}; closed cleanly: {closed}")
    lost = exporter.produced_points - held
    print(f"points produced {exporter.produced_points}, held by the collector {held}, lost {lost}")
    print(f"agent stats {stats}")


def main() -> None:
    """Parse the options, start a collector, run both parts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--float8-rounds", type=int, default=2, help="rounds of the torchao families (slow on a CPU)")
    parser.add_argument("--families", default="quantlinear,float8", help="comma-separated: quantlinear, float8, int8")
    parser.add_argument("--outage-seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-outage", action="store_true")
    parser.add_argument(
        "--whatif-periods",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[WHATIF_STEPS // qw.DEFAULT_EVERY],
        help=f"comma-separated what-if periods in sampled steps the defaults are composed for (default"
        f" {WHATIF_STEPS // qw.DEFAULT_EVERY}: every {WHATIF_STEPS} steps)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, batch {args.batch} x seq {args.seq}, pid {os.getpid()}, "
        f"load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="qw-bench-") as tmpdir:
        tmp = Path(tmpdir)
        collector = Collector(tmp / "collector.db", free_port())
        collector.start()
        try:
            gate_seconds = gate_cost()
            candidate_costs(args)
            if not args.skip_overhead:
                summary = {
                    family: overhead(args, collector, tmp, gate_seconds, family) for family in args.families.split(",")
                }
                print("\n== summary: median ratio to the family's unmonitored step (wall / CPU) ==")
                for family, ratios in summary.items():
                    names = [
                        "defaults_from_gate",
                        *(f"defaults_whatif{period}" for period in args.whatif_periods),
                        "every1",
                        "every1_whatif",
                        "every1_rows",
                        "tensorboard",
                        "ref_gemms",
                    ]
                    cells = [f"{name} {ratios[f'{name}_wall']:.3f}/{ratios[f'{name}_cpu']:.3f}" for name in names]
                    print(f"{family:<12} " + "  ".join(cells))
            if not args.skip_outage:
                outage(args, collector, tmp)
        finally:
            collector.stop()


if __name__ == "__main__":
    main()
