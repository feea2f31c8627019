"""What several benchmarks share: the per-layer metric names of the synthetic workload."""

# The metrics a training run reports per layer (as in the agent's defaults), in wire order.
METRICS = [
    "output_rel_l2",
    "output_cosine",
    "output_sqnr_db",
    "weight_rel_l2",
    "act_rel_l2",
    "grad_rel_l2",
    "underflow_ratio",
    "overflow_ratio",
]
