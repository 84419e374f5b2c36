"""Gradient accumulation across the pieces of one batch: one optimizer step per batch.

While a split batch runs (a *session*), four things of torch are stood in for (by
:mod:`._patches`, the one place torch is replaced) and routed to the session of the piece that
runs on the calling thread (calls from elsewhere pass through):

- ``torch.autograd.backward`` (which ``Tensor.backward`` calls): the gradient flowing in at
  the root is the piece's share of the batch's loss, so every gradient of the backward, of
  parameters, inputs and activations alike, is what the whole batch's backward gives it, and
  gradient hooks on activations see the values they would see unsplit. Leaves that receive a
  gradient are found in the graph first, so that each parameter's gradient is folded into a
  sum (below); a parameter with a gradient hook of its own is refused, since the hook would
  run on each micro-batch's part of the gradient instead of on the whole.
- ``GradScaler.unscale_/step/update`` of every scaler, and ``LRScheduler.step`` of every
  scheduler: deferred to the last piece for the scalers and the schedulers the step was given,
  refused before they act for the other schedulers.
- The helper of ``torch.nn.utils.clip_grad_*`` that groups gradients by device: with no
  gradient at all (an early piece) it returns nothing instead of failing.

As soon as a parameter's gradient is complete for a piece (its post-accumulate hook, which
runs before the user's own), it joins the sum: in an early piece it is added to a private
buffer, which ``.grad`` then shows (code between ``backward()`` and ``optimizer.step()``, and
hooks, read the sum so far; the ledger drops their writes to it, which the last piece makes on
the whole batch's gradient); in the last piece ``.grad`` takes the buffer in. So a split step holds the sum
and one parameter's new gradient, not a second whole gradient, and from the first fold on the
piece is :attr:`~_Accumulation.dirty`: if it fails, the batch starts over. The optimizers'
``step`` does nothing in early pieces and runs once in the last, with the whole batch's
gradient in ``.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from autobatch._errors import AutobatchError
from autobatch._recovery import _inspect, _ledger, _rules
from autobatch._recovery._patches import Patch, backward_handler, split_standins


def _add(total: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
    """``total + more``, in place where both are dense."""
    if total.layout == torch.strided and more.layout == torch.strided:
        return total.add_(more)
    return total + more


def _first(hooks: dict[Any, Any] | None, key: Any) -> None:
    """Make ``key``'s hook run before the others (autograd walks the dict in the order its
    entries were inserted, which ``OrderedDict.move_to_end`` does not change)."""
    if not hooks or key not in hooks or next(iter(hooks)) == key:
        return
    entries = list(hooks.items())
    hooks.clear()
    hooks[key] = dict(entries)[key]
    hooks.update((k, v) for k, v in entries if k != key)


class _Accumulation:
    """One optimizer step (per optimizer given) from the pieces of a batch (module docs).

    Parameters given to :meth:`accumulate_in_place` (FSDP2's unsharded parameters, whose
    gradients FSDP itself sums across micro-batches that skip reduction) are never stashed,
    merged or discarded: their ``.grad`` holds the earlier pieces' sum, so a piece that adds to
    it makes the batch start over if it fails (:attr:`dirty`), and :meth:`restart` clears it
    (and runs ``on_restart``).
    """

    def __init__(
        self,
        name: str,
        params: Iterable[torch.Tensor],
        optimizers: tuple[torch.optim.Optimizer, ...],
        scalers: tuple[Any, ...] = (),
        schedulers: tuple[Any, ...] = (),
        *,
        show_sums: bool = True,
    ) -> None:
        self.name = name
        self.params: list[torch.Tensor] = []
        self.ids: set[int] = set()
        self.handles: list[RemovableHandle] = []
        self.weight = 1.0
        self.last = False
        self.running = False
        #: what the piece did that the engine sees (backward, optimizer and scheduler steps), in
        #: order; every piece of a batch must do what its first did (:meth:`agree`)
        self.events: list[str] = []
        self.first_events: list[str] | None = None
        self.scaling = False  # inside a GradScaler's step in the last piece
        self.in_backward = 0
        self.contributed = False  # this piece's gradients reached the buffers, or .grad the sum
        self.moving = False
        self.buffers: dict[int, torch.Tensor] = {}
        self.sum_keys: set[int] = set()  # the buffers' storages (the ledger drops writes there)
        self.exposed: set[int] = set()  # parameters whose .grad shows their sum now
        #: show the sums so far in .grad (not under a process group: a step that reduces its
        #: gradients itself, with dist.all_reduce, skips what it does not find)
        self.show_sums = show_sums
        self.in_place: set[int] = set()
        self.unfolded: set[int] = set()  # gradients left in .grad until the backward ends
        self.on_restart: list[Callable[[], None]] = []
        self.on_backward: list[Callable[[], None]] = []  # after each backward of a piece
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self.stepped: set[int] = set()  # optimizers whose step was called in this piece
        self.schedulers = schedulers
        self.stepping_scheduler = False
        self.scalers_seen: list[Any] = list(scalers)
        self.patches = [
            Patch(o, "step", self._deferred_step(o, o.step)) for o in optimizers
        ]
        self.candidates = list(params)  # (tracked once they require gradients: unfrozen)
        self.track(self.candidates)
        # the gradients in .grad as the batch began (an earlier call's, which a piece folds
        # into the sum only when its backward reaches them), held weakly as the ledger does
        self.began = {
            id(p): weakref.ref(p.grad) for p in self.candidates if p.grad is not None
        }
        self.standins = contextlib.ExitStack()  # torch's entry points, routed here (_patches)
        self.standins.enter_context(split_standins(self))
        self.standins.enter_context(backward_handler(self._route_backward))

    # Parameters ------------------------------------------------------------------------------

    def track(self, params: Iterable[torch.Tensor], *, fold: bool = True) -> None:
        """Fold the gradients of ``params`` too (before their backward). ``fold=False``: their
        gradients stay in ``.grad`` until the backward ends, for someone else to take first
        (FSDP2 reduces its unsharded gradients in its post-backward)."""
        params = list(params)
        if not fold:
            self.unfolded.update(id(p) for p in params)
        for p in params:
            if p.requires_grad and id(p) not in self.ids:
                self.ids.add(id(p))
                self.params.append(p)
                handle = p.register_post_accumulate_grad_hook(self._accumulated)
                _first(getattr(p, "_post_accumulate_grad_hooks", None), handle.id)
                self.handles.append(handle)

    def accumulate_in_place(self, params: Iterable[torch.Tensor]) -> None:
        """Leave the gradients of ``params`` summed in ``.grad`` (FSDP2's unsharded ones)."""
        params = list(params)
        self.track(params, fold=False)
        self.in_place.update(id(p) for p in params)

    def begin_piece(self, weight: float, last: bool) -> None:
        self.hide()
        self.weight, self.last = weight, last
        self.events = []
        self.contributed = self.moving = False
        self.stepped.clear()
        self.running = True

    def end_piece(self) -> None:
        self.running = False
        self.hide()

    def _event(self, event: str) -> None:
        """The piece does ``event``; in the last piece, before it happens, it must be what the
        first piece did at that point (an optimizer step is deferred to the last piece)."""
        self.events.append(event)
        first = self.first_events
        if self.last and first is not None and self.events != first[: len(self.events)]:
            self._disagree(_inspect.user_frame())

    def agree(self) -> None:
        """After a piece that succeeded: it did what the batch's first piece did."""
        if self.first_events is None:
            self.first_events = self.events
        elif self.events != self.first_events:
            self._disagree("the end of a micro-batch")

    def _disagree(self, where: str) -> None:
        first, now = self.first_events or [], self.events
        at = next((i for i, (a, b) in enumerate(zip(first, now, strict=False)) if a != b),
                  min(len(first), len(now)))
        did, then = (events[at] if at < len(events) else "nothing more" for events in (now, first))
        raise _rules.refusal(
            self.name,
            f"took another path in one micro-batch than in the batch's first: {did} where the "
            f"first micro-batch did {then}", where,
            "the step decides from Python state that a micro-batch changes (a call counter, "
            "a flag, a list), so its micro-batches would not make the batch's one step",
            "decide from the batch or from the call's arguments, or keep the counter outside "
            "the decorated step (count the calls, then pass whether to step)",
        )

    @property
    def dirty(self) -> bool:
        """Whether the current piece changed the sum (then the batch must start over)."""
        return self.contributed or self.moving

    # Backward --------------------------------------------------------------------------------

    def _route_backward(self, real: Callable[..., Any], tensors: Any, grad_tensors: Any = None,
                        *args: Any, **kwargs: Any) -> Any:
        if not self.running or torch._C._current_autograd_node() is not None:
            return real(tensors, grad_tensors, *args, **kwargs)  # (a recomputation in backward)
        return self.backward(real, tensors, grad_tensors, *args, **kwargs)

    def backward(self, real: Callable[..., Any], tensors: Any, grad_tensors: Any,
                 *args: Any, **kwargs: Any) -> Any:
        """``torch.autograd.backward`` in a piece: the root weighted by the piece's share."""
        # (backward(tensors, grad_tensors, retain_graph, create_graph, ...))
        if kwargs.get("create_graph") or (len(args) > 1 and args[1]):
            self.differentiates_gradients("backward(create_graph=True)")
        self._event("backward()")
        # parameters the step made require gradients (a backbone unfrozen after warm-up):
        # the graph cannot show those a reentrant checkpoint runs, so they are looked up here
        self.track(p for p in self.candidates if p.requires_grad and id(p) not in self.ids)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if any(not isinstance(t, torch.Tensor) for t in roots):
            raise AutobatchError(
                f"{self.name} called backward() on gradient edges while its batch ran in "
                "micro-batches; autobatch weights each micro-batch at the loss, which it cannot "
                "do here. Call backward() on the loss tensor, or use policy='shrink'"
            )
        watched = _ledger.watching()
        if watched is not None and watched.rows is not None:
            watched.rows.check(roots, self.name)  # (a loss that mixes the batch's rows)
        inputs = kwargs.get("inputs")
        leaves = _inspect.leaves(roots) if inputs is None else list(
            [inputs] if isinstance(inputs, torch.Tensor) else inputs
        )
        fresh = [p for p in leaves if id(p) not in self.ids and isinstance(p, torch.nn.Parameter)]
        hooked = _inspect.gradient_hooks([  # (every tracked one: a reentrant checkpoint hides
            *self.params, *fresh])             # its parameters from the graph)
        if hooked:
            ledger = _ledger.watching()
            name = ledger.name_of(hooked[0]) if ledger is not None else "a parameter"
            raise _rules.refusal(
                self.name,
                f"backpropagates into {name} ({tuple(hooked[0].shape)}), which has a gradient "
                "hook (register_hook)",
                _inspect.user_frame(),
                "the hook would run on each micro-batch's part of the gradient instead of on "
                "the batch's (a clamp or a norm of parts is not the part of a clamp or a norm)",
                "do the hook's work between backward() and optimizer.step() (for clipping, "
                "torch.nn.utils.clip_grad_value_), where autobatch shows it the whole batch's "
                "gradient, or use policy='shrink'",
            )
        self.track(fresh)
        ledger = _ledger.watching()
        if ledger is not None and fresh:
            ledger.adopt(fresh)
            ledger.adopted += fresh
        if self.weight == 0.0:  # a piece without items: its loss (0/0) adds nothing
            self._backward_done()
            return None
        if self.weight != 1.0:
            grads = (
                [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else
                list(grad_tensors) if grad_tensors is not None else [None] * len(roots)
            )
            with _inspect.engine_work():
                grad_tensors = [
                    torch.full_like(t, self.weight) if g is None else g * self.weight
                    for t, g in zip(roots, grads, strict=True)
                ]
        self.hide()  # (a second backward in the piece: autograd makes fresh gradients)
        self.in_backward += 1
        try:
            result = real(roots, grad_tensors, *args, **kwargs)
        finally:
            self.in_backward -= 1
        self._backward_done()
        return result

    def grad_assigned(self, p: torch.Tensor) -> None:
        """The step is about to assign ``p.grad`` (not to ``None``): refused in an early piece,
        where autobatch holds the gradients itself (the assignment would bypass their weighting
        and their sum), before it happens."""
        if self.last or id(p) not in self.ids or _inspect._engine_busy():
            return
        if _inspect._from_distributed():  # (FSDP2 setting its sharded gradients)
            return
        ledger = _ledger.watching()
        name = ledger.name_of(p) if ledger is not None else "a parameter"
        raise _rules.refusal(
            self.name, f"set the gradient of {name} ({tuple(p.shape)}) itself",
            _inspect.user_frame(),
            "autobatch weights and adds the gradients that backward() accumulates; a gradient "
            "assigned to .grad (after torch.autograd.grad, or gradient surgery) cannot be "
            "weighted per micro-batch, so only the last micro-batch's would count",
            "compute gradients with loss.backward(), or use policy='shrink'",
        )

    def _accumulated(self, p: torch.Tensor) -> None:
        """After a gradient reached ``p.grad``: fold it into the sum right away, parameter by
        parameter, so that a split step holds one gradient's worth beside the step's own, not
        two. From the first fold on the piece is :attr:`dirty`."""
        grad = p.grad
        if grad is None or not self.running:
            return
        if not self.in_backward and self.weight != 1.0:
            raise AutobatchError(
                f"{self.name} ran a backward that did not go through torch.autograd.backward "
                "(a backward function imported before autobatch started, or a C++ extension) "
                "while its batch ran in micro-batches, so its gradients could not be weighted "
                "per micro-batch. Call loss.backward(), or use policy='shrink'"
            )
        owner = self.owner.get(id(p))
        if owner is not None and id(owner) in self.stepped:
            label = type(owner).__name__
            raise _rules.refusal(
                self.name,
                f"backpropagated into a parameter of {label} after {label}.step() in the same "
                "step", _inspect.user_frame(),
                "the step interleaves optimizers (as a GAN's discriminator, then generator, "
                "does); in micro-batches the early pieces would run before that update",
                "decorate each optimizer's part as its own function, or use policy='shrink'",
            )
        if id(p) in self.in_place:
            self.contributed = True  # the sum in .grad now holds part of this piece
        if id(p) in self.unfolded:  # (every in-place parameter among them)
            return
        with _inspect.engine_work():
            if self.last:
                buffer = self.buffers.pop(id(p), None)
                if buffer is not None:
                    self.contributed = True
                    p.grad = _add(grad, buffer)
                return
            self.contributed = True
            self._fold(p, grad)

    def _backward_done(self) -> None:
        if self.last:
            self.merge()
        else:
            self.stash()
        for done in self.on_backward:
            done()

    def _fold(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a piece's gradient into ``p``'s sum, and show the sum so far in ``.grad``
        (hooks and code before ``optimizer.step()`` read it; their writes to it are dropped
        by the ledger in an early piece, and made on the whole batch's in the last)."""
        buffer = self.buffers.get(id(p))
        if buffer is None or grad is buffer:
            buffer = grad  # (the first, or autograd added into the sum shown, in place)
        elif id(p) in self.exposed:
            buffer = grad  # (autograd added into the sum shown: the sum plus the new part)
        else:
            buffer = _add(buffer, grad)
        self.buffers[id(p)] = buffer
        self.sum_keys.add(_inspect._key(buffer))
        if self.show_sums:
            p.grad = buffer
            self.exposed.add(id(p))
        else:
            p.grad = None

    def grad_cleared(self, p: torch.Tensor) -> None:
        """The step set ``p.grad`` to ``None`` (``zero_grad()``): its sum is no longer shown
        (the sum itself stays, in the buffers)."""
        self.exposed.discard(id(p))

    def hide(self) -> None:
        """Take the sums so far out of ``.grad`` (before a backward, or between pieces)."""
        self.exposed.clear()
        with _inspect.engine_work():
            for p in self.params:
                grad = p.grad
                if grad is not None and grad is self.buffers.get(id(p)):
                    p.grad = None

    def stash(self) -> None:
        """Move the piece's gradients into the buffers (early pieces)."""
        self.moving = True
        with _inspect.engine_work():
            for p in self.params:
                grad = p.grad
                if grad is None or id(p) in self.in_place or grad is self.buffers.get(id(p)):
                    continue
                self.contributed = True
                self._fold(p, grad)
        self.moving = False

    def merge(self) -> None:
        """Add the earlier pieces' sums into ``.grad`` (the last piece)."""
        if not self.buffers:
            return
        self.moving = True
        with _inspect.engine_work():
            for p in self.params:
                buffer = None if id(p) in self.in_place else self.buffers.pop(id(p), None)
                if buffer is not None:
                    self.contributed = True
                    p.grad = buffer if p.grad is None else _add(p.grad, buffer)
        self.moving = False

    # Deferred steps --------------------------------------------------------------------------

    def _deferred_step(
        self, optimizer: torch.optim.Optimizer, real: Callable[..., Any]
    ) -> Callable[..., Any]:
        @functools.wraps(real)  # (an LR scheduler's mark on the step it wraps is kept)
        def only_in_last_piece(*args: Any, **kwargs: Any) -> Any:
            if args or kwargs.get("closure") is not None:
                raise AutobatchError(
                    "optimizer.step(closure) re-evaluates the loss, which cannot be split into "
                    "micro-batches; use policy='shrink' for closure-based optimizers such as LBFGS"
                )
            self.stepped.add(id(optimizer))
            if self.running and not self.scaling:
                self._event(f"{type(optimizer).__name__}.step()")
            if self.running and not self.last:
                return None
            self.merge()
            ledger = _ledger.watching()
            if ledger is None:
                return real(*args, **kwargs)
            with ledger.optimizer_step(optimizer):
                return real(*args, **kwargs)

        return only_in_last_piece

    def scaler_call(
        self, name: str, real: Callable[..., Any], scaler: Any, args: Any, kwargs: Any
    ) -> Any:
        """A GradScaler's ``unscale_``/``step``/``update`` in a piece: the last piece's only
        (so its inf check covers the whole batch's gradient once)."""
        if all(scaler is not s for s in self.scalers_seen):
            self.scalers_seen.append(scaler)
        if name == "step" and self.running and args:
            self._event(f"{type(args[0]).__name__}.step()")  # (the step it makes, or skips)
        if not self.last:
            return None
        scaling = self.scaling  # (scaler.step calls unscale_ itself when the step did not)
        if name == "step":
            self.merge()
            self.scaling = True  # (its optimizer step is this event, not another)
        try:
            return real(scaler, *args, **kwargs)
        finally:
            self.scaling = scaling

    def differentiates_gradients(self, call: str) -> None:
        """The piece differentiates a gradient again (a gradient penalty): refused, unless
        the piece is the whole batch."""
        if self.weight == 1.0 and self.last:
            return
        raise _rules.refusal(
            self.name, f"called {call} (a gradient differentiated again: a gradient penalty)",
            _inspect.user_frame(),
            "a penalty on a gradient is not a sum over the batch's rows that micro-batches "
            "can weight (the gradient of a mean scales with the batch's size, and its square "
            "with the square of it), so the micro-batches' gradients would not add up to the "
            "batch's",
            "make the batch fit (a smaller batch_size, or min_batch= with policy='shrink'), "
            "or compute the penalty outside the decorated step",
        )

    def scheduler_call(self, real: Callable[..., Any], scheduler: Any, args: Any, kwargs: Any) -> Any:
        """An LR scheduler's ``step`` in a piece: a scheduler given steps in the last piece
        only; any other is refused before it steps (in an early piece)."""
        given = any(scheduler is s for s in self.schedulers)
        label = type(scheduler).__name__
        if self.running:
            self._event(f"{label}.step()")
        if args or kwargs:
            if self.last:
                return self._step_scheduler(real, scheduler, args, kwargs)
            raise _rules.refusal(
                self.name, f"called {label}.step() with arguments", _inspect.user_frame(),
                "its arguments (a loss, say) are the micro-batch's, not the batch's",
                f"call {label}.step(...) after the decorated step returns",
            )
        if given:
            if not self.last:
                return None
            return self._step_scheduler(real, scheduler, args, kwargs)
        if self.last:
            return self._step_scheduler(real, scheduler, args, kwargs)
        raise _rules.refusal(
            self.name, f"called {label}.step(), a scheduler autobatch was not given",
            _inspect.user_frame(),
            "it would step once per micro-batch instead of once per batch",
            "pass it: retry_on_oom(optimizer=opt, scheduler=sched) (it then steps once per "
            "batch, in the last micro-batch), or step it after the decorated step returns",
        )

    def _step_scheduler(self, real: Callable[..., Any], scheduler: Any, args: Any, kwargs: Any) -> Any:
        self.stepping_scheduler = True
        try:
            return real(scheduler, *args, **kwargs)
        finally:
            self.stepping_scheduler = False

    # Failures --------------------------------------------------------------------------------

    def _began_with(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is still the gradient the batch began with."""
        began = self.began.get(id(p))
        return began is not None and began() is p.grad

    def discard(self) -> None:
        """Forget the failed piece's gradients; the earlier pieces' sums stay, and so do the
        gradients the batch began with that an early piece left in ``.grad`` (it failed
        before it added to them, or it would be :attr:`dirty`)."""
        for p in self.params:
            if id(p) not in self.in_place and (self.last or not self._began_with(p)):
                p.grad = None

    def restart(self) -> None:
        """Forget every piece: gradients to ``None`` (the ledger puts back what was there),
        except those the batch began with, which the ledger holds only weakly."""
        self.buffers.clear()
        self.sum_keys.clear()
        self.exposed.clear()
        self.first_events = None
        for p in self.params:
            if id(p) in self.in_place or not self._began_with(p):
                p.grad = None
        for forget in self.on_restart:
            forget()

    def close(self) -> None:
        self.running = False
        self.standins.close()
        self.merge()
        for handle in self.handles:
            handle.remove()
        for patch in reversed(self.patches):
            patch.undo()


def reset_scalers(
    fn: Any, optimizers: Iterable[torch.optim.Optimizer], given: Any,
    session: _Accumulation | None,
) -> None:
    """After a failed attempt: every GradScaler the step used forgets what it did for the
    step's optimizers (``unscale_``): the one given, those a split batch saw, and those the
    step refers to (its closure, globals, ``self``, and what they hold), so that a scaler not
    given as ``scaler=`` is reset too."""
    found: dict[int, Any] = {id(s): s for s in (
        *(session.scalers_seen if session is not None else ()), *(() if given is None else (given,))
    )}
    for _, value in _inspect.reachable(fn):
        if isinstance(value, torch.amp.GradScaler):
            found.setdefault(id(value), value)
    for scaler in found.values():
        for optimizer in optimizers:
            _reset_scaler(scaler, optimizer)


def _reset_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Drop the GradScaler's per-optimizer stage (after ``unscale_`` in a failed attempt).

    GradScaler has no public way to do this; ``update()`` does the same for every optimizer.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, dict):
        states.pop(id(optimizer), None)
