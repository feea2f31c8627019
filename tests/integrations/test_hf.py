"""The Hugging Face callback in a real ``transformers.Trainer`` on a tiny Llama (random init, no download), on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import quantwatch.agent as qw
from quantwatch.integrations.hf import QuantWatchCallback
from quantwatch.kernels import QuantConfig, Recipe, quantize_model

transformers = pytest.importorskip("transformers")

STEPS = 12


def _tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    return quantize_model(model, Recipe(default=QuantConfig()))


def _data(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, length), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _trainer(model: Any, out: Path, callback: QuantWatchCallback, max_steps: int, **args: Any) -> Any:
    arguments = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **args,
    )
    return transformers.Trainer(model=model, args=arguments, train_dataset=_data(), callbacks=[callback])


def _linear_names(model: Any) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def test_every_optimizer_step_arrives_with_every_linear_layer_and_the_loss(tmp_path: Path) -> None:
    model = _tiny_llama()
    sink = qw.InMemoryExporter()
    callback = QuantWatchCallback(run="hf-llama", exporter=sink, every=1)
    _trainer(model, tmp_path, callback, STEPS, save_strategy="no").train()
    assert callback.monitor is None  # closed at on_train_end
    steps = [record for batch in sink.batches for record in batch.steps]
    assert [r.step for r in steps] == list(range(1, STEPS + 1))
    layers = sink.batches[0].layers
    assert sorted(layers) == sorted(_linear_names(model))
    for record in steps:
        assert {"loss", "learning_rate", "grad_norm", "tokens_per_second"} <= set(record.scalars)
        assert all(v is not None for v in record.metrics["update_cosine"]), record.step
        assert all(v is not None for v in record.metrics["output_rel_l2"]), record.step


def test_invalid_options_fail_when_the_callback_is_built() -> None:
    with pytest.raises(qw.ConfigError, match="every"):
        QuantWatchCallback(run="hf", every=0)
    with pytest.raises(qw.ConfigError, match="evry"):
        QuantWatchCallback(run="hf", evry=10)
    with pytest.raises(qw.ConfigError, match="run"):
        QuantWatchCallback(run="bad name!")


@pytest.mark.slow
def test_a_run_resumed_from_its_checkpoint_continues_its_steps(tmp_path: Path, sqlite_collector: Any) -> None:
    url = sqlite_collector.url
    first = _trainer(_tiny_llama(), tmp_path, QuantWatchCallback(run="hf-resume", url=url, every=1), 8, save_steps=6)
    first.train()
    again = _trainer(
        _tiny_llama(), tmp_path, QuantWatchCallback(run="hf-resume", url=url, every=1), STEPS, save_steps=100
    )
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    with httpx.Client(base_url=url) as http:
        run = http.get("/api/v1/runs").json()[0]
        loss = http.get("/api/v1/runs/hf-resume/series", params={"scalar": "loss"}).json()
    assert (run["first_step"], run["last_step"]) == (1, STEPS)
    assert loss["steps"] == list(range(1, STEPS + 1))


class _StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    """Asks QuantWatch to stop training at the end of optimizer step ``step``, as an ``on_alert`` callback would."""

    def __init__(self, quantwatch: QuantWatchCallback, step: int) -> None:
        self.quantwatch, self.step = quantwatch, step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            qw.actions.stop_training(monitor=self.quantwatch.monitor)


def test_stop_training_stops_the_trainer_at_the_next_step_boundary(tmp_path: Path) -> None:
    sink = qw.InMemoryExporter()
    callback = QuantWatchCallback(run="hf-stop", exporter=sink, every=1)
    trainer = _trainer(_tiny_llama(), tmp_path, callback, STEPS, save_strategy="no")
    trainer.add_callback(_StopAt(callback, 4))
    trainer.train()
    # Step 4 reaches the monitor at step 5's start (once its scalars are in): the stop takes effect there, and the
    # Trainer ends before step 5's optimizer step instead of running to STEPS.
    assert trainer.state.global_step == 4
    assert [r.step for batch in sink.batches for r in batch.steps] == [1, 2, 3, 4]
    assert [(a.step, a.action) for batch in sink.batches for a in batch.actions] == [(4, "stop_training")]
