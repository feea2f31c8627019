"""QuantWatch: watch quantization error while low-precision training runs.

The distribution has three parts, each importable on its own:

* :mod:`quantwatch.kernels` — number formats, quantizers, error statistics, quantized layers (needs torch);
* :mod:`quantwatch.agent` — the training-side agent that measures layers and streams figures (needs torch);
* :mod:`quantwatch.service` — the collector: ingest, history, alerts, Prometheus (no torch).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
