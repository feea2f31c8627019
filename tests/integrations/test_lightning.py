"""The Lightning callback in a real ``lightning.Trainer`` on CPU, with gradient accumulation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quantwatch.agent as qw
from quantwatch.integrations.lightning import QuantWatchCallback
from quantwatch.kernels import QuantConfig, Recipe, quantize_model

lightning = pytest.importorskip("lightning")

STEPS = 12


class Regression(lightning.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(module: Any, root: Any, callbacks: list[Any], **options: Any) -> Any:
    """Fit ``module`` for STEPS optimizer steps on CPU with ``callbacks``; the trainer."""
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
        **options,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


def _watched(run: str) -> tuple[Regression, qw.InMemoryExporter, QuantWatchCallback]:
    """A quantized, seeded module, and a callback measuring every step of ``run`` into the in-memory exporter."""
    torch.manual_seed(0)
    module = Regression()
    quantize_model(module, Recipe(default=QuantConfig()))
    sink = qw.InMemoryExporter()
    return module, sink, QuantWatchCallback(run=run, exporter=sink, every=1)


def test_every_optimizer_step_arrives_with_the_modules_layer_names(tmp_path: Any) -> None:
    module, sink, callback = _watched("lightning-mlp")
    _fit(module, tmp_path, [callback], accumulate_grad_batches=2)
    steps = [record for batch in sink.batches for record in batch.steps]
    assert [r.step for r in steps] == list(range(1, STEPS + 1))
    assert sink.batches[0].layers == ("body.0", "body.2")
    for record in steps:
        assert {"loss", "learning_rate"} <= set(record.scalars)
        assert all(v is not None for v in record.metrics["update_cosine"]), record.step


def test_invalid_options_fail_when_the_callback_is_built() -> None:
    with pytest.raises(qw.ConfigError, match="ranks"):
        QuantWatchCallback(run="pl", ranks="some")


class _StopAt(lightning.pytorch.Callback):  # type: ignore[misc]
    """Asks QuantWatch to stop training after optimizer step ``step``, as an ``on_alert`` callback would."""

    def __init__(self, quantwatch: QuantWatchCallback, step: int) -> None:
        self.quantwatch, self.step = quantwatch, step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step and self.quantwatch.monitor is not None:
            qw.actions.stop_training(monitor=self.quantwatch.monitor)


def test_stop_training_stops_the_fit_at_the_next_step_boundary(tmp_path: Any) -> None:
    module, sink, callback = _watched("lightning-stop")
    trainer = _fit(module, tmp_path, [callback, _StopAt(callback, 4)])
    assert trainer.global_step < STEPS
    steps = [r.step for batch in sink.batches for r in batch.steps]
    assert steps == list(range(1, trainer.global_step + 1))
    assert [(a.step, a.action) for batch in sink.batches for a in batch.actions] == [(4, "stop_training")]
