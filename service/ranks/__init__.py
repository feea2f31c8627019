"""Checks across the ranks of a run: master weights that must agree within a data-parallel replica group
(``rank_weight_mismatch``) and the environment each rank reports (``GET /api/v1/runs/{run}/ranks``); mounted by
:func:`quantwatch.service.ranks.setup.install_ranks`."""
