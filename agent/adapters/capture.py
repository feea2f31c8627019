"""Capturing the casts a torchao layer makes itself, so that a sampled step measures them without casting again.

A torchao layer calls its cast function (``hp_tensor_to_float8_dynamic`` in float8 training,
``quantize_int8_rowwise`` in INT8 mixed-precision training) through its module's globals at each call.  While any
measurer listens (its layer's step is sampled) a wrapper stands in that global: it calls torchao's function, then
hands the call's arguments and result to the thread's current listener — the measurer whose layer's forward, or
whose layer's backward node, is running (set by a hook before it, cleared by one after it).  The original is back in
place as soon as the last measurer stops listening: an unsampled step runs torchao untouched.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CastCapture", "CastListener"]

#: What a listener is handed: the cast function's positional and keyword arguments, and what it returned.
CastListener = Callable[[tuple[Any, ...], dict[str, Any], Any], None]


class CastCapture:
    """The wrapper of the function ``attribute`` of the torchao module ``module`` (see the module doc)."""

    def __init__(self, module: str, attribute: str) -> None:
        self.module = module
        self.attribute = attribute
        self.listening = 0
        self.original: Callable[..., Any] | None = None
        self.local = threading.local()

    def available(self) -> bool:
        """Whether the module is loaded and calls the function through the global the wrapper replaces."""
        module = sys.modules.get(self.module)
        return module is not None and callable(getattr(module, self.attribute, None))

    def start(self) -> None:
        """One more measurer listens (the first installs the wrapper)."""
        if self.original is None:
            module = sys.modules[self.module]
            self.original = getattr(module, self.attribute)
            setattr(module, self.attribute, functools.partial(self._capturing, self.original))
        self.listening += 1

    def stop(self) -> None:
        """One measurer less (the last puts torchao's function back)."""
        self.listening -= 1
        if self.listening <= 0 and self.original is not None:
            setattr(sys.modules[self.module], self.attribute, self.original)
            self.original = None
            self.listening = 0

    def enter(self, listener: CastListener) -> None:
        """Casts made by this thread from now on are ``listener``'s (until `leave`)."""
        self.local.current = listener

    def leave(self) -> None:
        """Casts made by this thread are nobody's."""
        self.local.current = None

    def _capturing(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # `function` is torchao's, bound when the wrapper was installed: a call after it was put back (a forward
        # that looked the wrapper up before) still runs it.
        result = function(*args, **kwargs)
        listener = getattr(self.local, "current", None)
        if listener is not None:
            listener(args, kwargs, result)
        return result
