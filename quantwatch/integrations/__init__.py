"""Callbacks for the trainers people already use, each a thin layer over :func:`quantwatch.agent.attach`:

* :mod:`quantwatch.integrations.hf` — ``transformers.Trainer`` (``QuantWatchCallback``);
* :mod:`quantwatch.integrations.lightning` — ``lightning.Trainer`` (``QuantWatchCallback``).

Each module imports its trainer only when it is imported itself.
"""
