"""The training-side agent: hooks quantized layers, measures them against their FP32 shadow and streams the figures.

```python
import quantwatch.agent as qw
monitor = qw.attach(model, run="gpt-fp4-a", url="http://127.0.0.1:8000", every=10)
for step, batch in enumerate(loader):
    loss = loss_fn(model(batch.x), batch.y); loss.backward(); opt.step(); opt.zero_grad()
    monitor.step(step, loss=loss)
monitor.close()
```
"""

try:
    import torch as _torch  # noqa: F401  (the agent's one hard requirement, checked once with a clear message)
except ImportError as _missing:
    raise ImportError("quantwatch.agent needs PyTorch: pip install 'quantwatch[agent]'") from _missing

from quantwatch.agent import actions, errors
from quantwatch.agent.actions import Alert
from quantwatch.agent.adapters import (
    Adapter,
    AdapterContext,
    AdapterHandle,
    LayerInfo,
    ShadowedLayer,
    UnsupportedLayerError,
    register_adapter,
)
from quantwatch.agent.engine import DeliveryResult
from quantwatch.agent.errors import *  # noqa: F403 (the whole error hierarchy, listed once: errors.__all__)
from quantwatch.agent.exporters import Exporter, HttpExporter, InMemoryExporter, JsonLinesExporter, RetryPolicy
from quantwatch.agent.monitor import DEFAULT_EVERY, Monitor, attach
from quantwatch.agent.sampling import Schedule
from quantwatch.agent.validation import DEFAULT_METRICS
from quantwatch.agent.wire import Batch, StepRecord, encode_batch
from quantwatch.protocol import LAYER_METRICS

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_METRICS",
    "LAYER_METRICS",
    "Adapter",
    "AdapterContext",
    "AdapterHandle",
    "Alert",
    "Batch",
    "DeliveryResult",
    "Exporter",
    "HttpExporter",
    "InMemoryExporter",
    "JsonLinesExporter",
    "LayerInfo",
    "Monitor",
    "RetryPolicy",
    "Schedule",
    "ShadowedLayer",
    "StepRecord",
    "UnsupportedLayerError",
    "actions",
    "attach",
    "encode_batch",
    "register_adapter",
]
__all__ += errors.__all__
