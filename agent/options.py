"""Checking :func:`~quantwatch.agent.attach` options before there is a model to attach to.

Integrations (the Hugging Face and Lightning callbacks) are built long before training starts; a mistake in their
options must surface when they are constructed, not at the first step of a run.
"""

from __future__ import annotations

import inspect
from typing import Any

from quantwatch.agent.errors import ConfigError
from quantwatch.agent.monitor import DEFAULT_EVERY, attach
from quantwatch.agent.sampling import Schedule
from quantwatch.agent.validation import check_run, check_shadow, check_step_options, periods, reports

__all__ = ["check_attach_options"]


def check_attach_options(**options: Any) -> None:
    """Raise :class:`ConfigError` naming the first option of ``options`` that :func:`attach` would refuse.

    Checks every option that can be judged without a model; ``layers``, ``exporter``, ``spool_dir`` and ``rank``
    are checked again by ``attach()`` when the model is there.
    """
    known = [name for name in inspect.signature(attach).parameters if name != "model"]
    for name in options:
        if name not in known:
            raise ConfigError(name, f"is not an option of attach(); options: {', '.join(known)}")
    if options.get("run") is not None:
        check_run(options["run"])
    shadow = options.get("shadow", "layer")
    check_shadow(shadow)
    Schedule(
        periods(options.get("metrics"), options.get("every", DEFAULT_EVERY), shadow),
        start=options.get("start", 0),
        end=options.get("end"),
    )
    reports(0, options.get("ranks", "all"))
    check_step_options(
        options.get("tokens_per_step"),
        options.get("scalars_every", 1),
        options.get("whatif_every"),
    )
    url = options.get("url")
    if url is not None and not isinstance(url, str):
        raise ConfigError("url", f"must be a string, got {type(url).__name__}")
