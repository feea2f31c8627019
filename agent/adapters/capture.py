"""Capturing the casts a torchao layer makes itself, so that a sampled step measures them without casting again.

A torchao layer calls its cast function (``hp_tensor_to_float8_dynamic`` in float8 training,
``quantize_int8_rowwise`` in INT8 mixed-precision training) through its module's globals at each call.  While any
measurer listens (its layer's step is sampled) a wrapper stands in that global: it calls torchao's function, then
hands the call's arguments and result to the thread's current listener — the measurer whose layer's forward, or
whose layer's backward node, is running (set by a hook before it, cleared by one after it).  The original is back in
place as soon as the last measurer stops listening: an unsampled step runs torchao untouched.
"""

from __future__ import annotations

import abc
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from quantwatch.agent.adapters.linear import RecomputedCastLinear, in_backward
from quantwatch.agent.layers import KIND_GRAD

__all__ = ["CapturedCastLinear", "CastCapture", "CastListener"]

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


class CapturedCastLinear(RecomputedCastLinear, abc.ABC):
    """A measurer of the casts its layer makes itself, through the subclass's :attr:`capture`: while its step is
    sampled, the casts of the layer's forward, then those of its backward node (`_backward_node`; None: the
    gradient cast is recomputed instead), reach `_on_captured` with whether they came in the forward.

    A forward that activation checkpointing re-runs inside a backward makes the first run's casts again (measured
    then) and may stop at its last saved tensor, before its forward hook: it gets no listener, which would take the
    backward node's casts."""

    capture: CastCapture

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listening = False
        self._rerun = False  # the running forward is one activation checkpointing re-runs

    def _arm_casts(self) -> None:
        self.capture.start()
        self._listening = True
        self._handles.append(self.module.register_forward_pre_hook(self._enter_forward))
        self._handles.append(self.module.register_forward_hook(self._leave_forward))

    def disarm(self) -> None:
        """Also stop listening to torchao's casts."""
        super().disarm()
        if self._listening:
            self._listening = False
            self.capture.leave()
            self.capture.stop()

    def _enter_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._rerun = in_backward()
        if not self._rerun:
            self._entering(None)
            self.capture.enter(self._listener(forward=True))

    def _leave_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._rerun:
            self.capture.leave()
        if KIND_GRAD not in self.kinds or not isinstance(output, Tensor) or output.grad_fn is None:
            return
        node = self._backward_node(output.grad_fn)
        if node is None:
            grad_cast = self.casts.get(KIND_GRAD)
            if grad_cast is not None:  # recompute the gradient cast, as RecomputedCastLinear does
                output.grad_fn.register_prehook(functools.partial(self._on_grad_output, grad_cast, output.output_nr))
            return
        node.register_prehook(self._enter_backward)
        node.register_hook(self._leave_backward)

    def _enter_backward(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        self._entering(grad_outputs)
        self.capture.enter(self._listener(forward=False))

    def _leave_backward(self, grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]) -> None:
        self.capture.leave()
        self._left_backward()

    def _listener(self, *, forward: bool) -> CastListener:
        # Called inside torchao's cast, so inside training: whatever it raises is counted, never raised.
        return functools.partial(self._guard, "cast_stats", self._on_captured, forward)

    def _backward_node(self, node: Any) -> Any | None:
        """The layer's backward node, found from its output's ``grad_fn`` (None: not found)."""
        return node

    def _entering(self, grad_outputs: tuple[Tensor | None, ...] | None) -> None:
        """Before the casts of a forward (None) or of the backward node (given its output gradients)."""

    def _left_backward(self) -> None:
        """After the backward node's casts."""

    @abc.abstractmethod
    def _on_captured(self, forward: bool, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """One cast the layer made: the cast function's arguments and result (inside the listener's guard)."""
