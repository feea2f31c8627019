"""``quantwatch demo``: the whole system in one process, in under a minute, on a laptop CPU.

A small transformer learns a synthetic task (next token of a seeded Markov chain: no downloads) with a mixed
low-precision recipe made by ``quantize_model``: FP8 for the sensitive layers (attention, output head), NVFP4 for the
MLPs, and plain FP4 with one per-tensor scale — weights, inputs and gradients — for one MLP projection: the
configuration that goes wrong. Its output gradients span more range than one FP4 scale can hold, the small ones
underflow, and the direction of its weight update drifts away from the FP32 reference until it is more than 5% off
(``update_cosine`` below 0.95), while every other layer stays above 0.99.

The agent is attached with a layer shadow for every quantized layer and a full FP32 shadow model trained in lockstep;
it streams to a collector started in this process (SQLite ``./quantwatch-demo.db``) with exactly the shipped alert
rules (:func:`receiver_rules` only adds the receiver), and a webhook receiver in this process prints each alert as it
arrives after checking its Standard Webhooks signature.

This package imports torch; the collector (``quantwatch.service``) never does.
"""

from __future__ import annotations

from quantwatch.demo.model import MarkovTask, TinyTransformer
from quantwatch.demo.options import DEFAULT_STEPS, DemoOptions, DemoResult
from quantwatch.demo.recipes import (
    PER_TENSOR_FP4_LAYER,
    RECIPES,
    UPDATE_RULE,
    make_recipe,
    receiver_rules,
)
from quantwatch.demo.run import run_demo
from quantwatch.demo.webhooks import Notification, WebhookReceiver, verify_webhook

__all__ = [
    "DEFAULT_STEPS",
    "PER_TENSOR_FP4_LAYER",
    "RECIPES",
    "UPDATE_RULE",
    "DemoOptions",
    "DemoResult",
    "MarkovTask",
    "Notification",
    "TinyTransformer",
    "WebhookReceiver",
    "make_recipe",
    "receiver_rules",
    "run_demo",
    "verify_webhook",
]
