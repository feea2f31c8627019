"""What-if statistics on the collector: stored per (run, rank, step, layer, kind, candidate), answered by
``/runs/{run}/whatif``, and the advice (``/runs/{run}/advice``, alert ``remediation``) computed from them."""
