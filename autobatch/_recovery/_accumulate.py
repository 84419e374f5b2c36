"""Gradient accumulation across the pieces of one batch: one optimizer step per batch."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from autobatch._errors import AutobatchError


class _Patch:
    """Replace an attribute of an object for a while (instance attribute, restored exactly)."""

    def __init__(self, obj: object, name: str, replacement: Callable[..., Any]) -> None:
        self.obj, self.name = obj, name
        self.had = name in vars(obj)
        self.previous = vars(obj).get(name)
        setattr(obj, name, replacement)

    def undo(self) -> None:
        if self.had:
            setattr(self.obj, self.name, self.previous)
        else:
            delattr(self.obj, self.name)


def _add(total: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
    """``total + more``, in place where both are dense."""
    if total.layout == torch.strided and more.layout == torch.strided:
        return total.add_(more)
    return total + more


class _Accumulation:
    """One optimizer step (per optimizer given) from the pieces of a batch.

    Every gradient that flows into a tracked parameter is weighted by the piece's share of the
    batch (in place once it reaches an empty ``.grad``; on its way in where ``.grad`` already
    holds one), so several ``backward()`` calls in one piece are weighted alike. As soon as a
    parameter's gradient is there (its post-accumulate hook), it joins the sum: in an early
    piece it is added to a private buffer and ``.grad`` is emptied (code between ``backward()``
    and ``optimizer.step()`` then finds nothing to clip or log); in the last piece ``.grad``
    takes the buffer in. So a split step holds the sum and one parameter's new gradient, not a
    second whole gradient, and from the first such addition the piece is :attr:`dirty`: if it
    fails, the batch starts over. At the end of each backward (an autograd callback) whatever is
    left is moved or added the same way, so from there on the last piece's ``.grad`` holds the
    whole batch's gradient, also for parameters the last piece did not reach. The optimizers'
    ``step`` and the scaler's ``unscale_``/``step``/``update`` do nothing in early pieces and run
    once in the last. A parameter that receives a gradient after its optimizer stepped in the
    same piece means the step interleaves optimizers (a GAN): refused, since early pieces would
    see the parameters before their update.

    Parameters given to :meth:`accumulate_in_place` (FSDP2's unsharded parameters, whose
    gradients FSDP itself sums across micro-batches that skip reduction) are weighted alike but
    never stashed, merged or discarded: their ``.grad`` holds the earlier pieces' sum, so a
    piece that adds to it makes the batch start over if it fails (:attr:`dirty`), and
    :meth:`restart` clears it (and runs ``on_restart``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizers: tuple[torch.optim.Optimizer, ...],
        scaler: Any,
    ) -> None:
        self.params: list[torch.Tensor] = []
        self.ids: set[int] = set()
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self.handles: list[RemovableHandle] = []
        self.weight = 1.0
        self.last = False
        self.queued = False
        self.contributed = False  # this piece's gradients reached the buffers, or .grad the sum
        self.moving = False
        self.stepped: set[int] = set()
        self.pending: set[int] = set()  # parameters whose fresh .grad is still to be weighted
        self.buffers: dict[int, torch.Tensor] = {}
        self.carried: dict[int, torch.Tensor] = {}  # gradients from before the batch (kept)
        self.carried_merged = False  # they are in .grad again: a restart could not undo that
        self.in_place: set[int] = set()
        self.unfolded: set[int] = set()  # gradients left in .grad until the backward ends
        self.on_restart: list[Callable[[], None]] = []
        self.patches = [
            _Patch(o, "step", self._deferred(o.step, refuse_closure=True, marks=True))
            for o in optimizers
        ]
        if scaler is not None:
            self.patches += [
                _Patch(scaler, name, self._deferred(
                    getattr(scaler, name), refuse_closure=False, marks=name == "step"
                ))
                for name in ("unscale_", "step", "update")
            ]
        self.track(params)

    def track(self, params: Iterable[torch.Tensor], *, fold: bool = True) -> None:
        """Weight and accumulate the gradients of ``params`` too (before their backward).
        ``fold=False``: their gradients stay in ``.grad`` until the backward ends, for someone
        else to take first (FSDP2 reduces its unsharded gradients in its post-backward)."""
        params = list(params)
        if not fold:
            self.unfolded.update(id(p) for p in params)
        for p in params:
            if p.requires_grad and id(p) not in self.ids:
                self.ids.add(id(p))
                self.params.append(p)
                self.handles += [
                    p.register_hook(functools.partial(self._incoming, p)),
                    p.register_post_accumulate_grad_hook(self._accumulated),
                ]

    def accumulate_in_place(self, params: Iterable[torch.Tensor]) -> None:
        """Weight the gradients of ``params`` too, and leave their sum in ``.grad``."""
        params = list(params)
        self.track(params, fold=False)
        self.in_place.update(id(p) for p in params)

    def begin_piece(self, weight: float, last: bool) -> None:
        self.weight, self.last = weight, last
        self.queued = self.contributed = self.moving = False
        self.stepped.clear()
        self.pending.clear()

    @property
    def dirty(self) -> bool:
        """Whether the current piece changed the sum (then the batch must start over)."""
        return self.contributed or self.moving

    def _incoming(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Before a gradient reaches ``p.grad``. Where ``p.grad`` is empty the gradient is
        weighted in place once it is there (no copy); else (a second backward into the same
        ``.grad``) the incoming gradient is weighted on its way in."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if id(p) in self.in_place:
            self.contributed = True  # the sum in .grad now holds part of this piece
        owner = self.owner.get(id(p))
        if owner is not None and id(owner) in self.stepped:
            raise AutobatchError(
                f"a parameter of {type(owner).__name__} received a gradient after "
                f"{type(owner).__name__}.step() in the same step: the step interleaves "
                "optimizers (as a GAN's discriminator, then generator, does). In micro-batches "
                "the early pieces would run before that update, so the batch cannot be split "
                "exactly: decorate each optimizer's part as its own function, or use "
                "policy='shrink'"
            )
        if self.weight == 1.0:
            return None
        if p.grad is None:
            self.pending.add(id(p))
            return None
        if self.weight == 0.0:  # a piece without items: its loss (0/0) adds nothing
            return torch.zeros_like(grad)
        return grad * self.weight

    def _accumulated(self, p: torch.Tensor) -> None:
        """After a gradient reached ``p.grad``: weight it (where it arrived in an empty
        ``.grad``), then fold it into the sum right away, parameter by parameter, so that a
        split step holds one gradient's worth beside the step's own, not two: an early piece's
        gradient joins its buffer and leaves ``.grad``; in the last piece ``.grad`` takes the
        buffer in. From the first fold on the piece is :attr:`dirty` (a sum cannot be taken
        apart again): if it fails, the batch starts over."""
        grad = p.grad
        if grad is None:
            return
        if id(p) in self.pending:
            self.pending.discard(id(p))
            if self.weight == 0.0:
                grad.zero_()
            else:
                grad.mul_(self.weight)
        if id(p) in self.unfolded:  # (every in-place parameter among them)
            return
        if self.last:
            buffer = self.buffers.pop(id(p), None)
            if buffer is not None:
                self.contributed = True
                p.grad = _add(grad, buffer)
            return
        self.contributed = True
        buffer = self.buffers.get(id(p))
        self.buffers[id(p)] = grad if buffer is None else _add(buffer, grad)
        p.grad = None

    def _backward_done(self) -> None:
        self.queued = False
        if self.last:
            self.merge()
        else:
            self.stash()

    def stash(self) -> None:
        """Move the piece's gradients into the buffers (early pieces)."""
        self.moving = True
        for p in self.params:
            grad = p.grad
            if grad is None or id(p) in self.in_place:
                continue
            self.contributed = True
            buffer = self.buffers.get(id(p))
            self.buffers[id(p)] = grad if buffer is None else _add(buffer, grad)
            p.grad = None
        self.moving = False

    def carry(self) -> None:
        """Set the gradients accumulated before this batch aside, to be added back at the end
        (a step that leaves the optimizer step to its caller, who may accumulate over calls)."""
        for p in self.params:
            if p.grad is not None:
                self.carried[id(p)] = p.grad
                p.grad = None

    def merge(self) -> None:
        """Add the earlier pieces' sums (and what was carried) into ``.grad`` (the last piece)."""
        if not self.buffers and not self.carried:
            return
        self.moving = True
        self.carried_merged = self.carried_merged or bool(self.carried)
        for p in self.params:
            for store in (self.buffers, self.carried):
                buffer = None if id(p) in self.in_place else store.pop(id(p), None)
                if buffer is not None:
                    self.contributed = True
                    p.grad = buffer if p.grad is None else _add(p.grad, buffer)
        self.moving = False

    def _deferred(
        self, real: Callable[..., Any], *, refuse_closure: bool, marks: bool
    ) -> Callable[..., Any]:
        def only_in_last_piece(*args: Any, **kwargs: Any) -> Any:
            if refuse_closure and (args or kwargs.get("closure") is not None):
                raise AutobatchError(
                    "optimizer.step(closure) re-evaluates the loss, which cannot be split into "
                    "micro-batches; use policy='shrink' for closure-based optimizers such as LBFGS"
                )
            if marks:
                owner = getattr(real, "__self__", None)
                if not isinstance(owner, torch.optim.Optimizer):
                    owner = args[0] if args else kwargs.get("optimizer")
                self.stepped.add(id(owner))
            if not self.last:
                return None
            self.merge()
            return real(*args, **kwargs)

        return only_in_last_piece

    def discard(self) -> None:
        """Forget the failed piece's gradients; the earlier pieces' sums stay."""
        for p in self.params:
            if id(p) not in self.in_place:
                p.grad = None

    def restart(self) -> None:
        """Forget every piece: gradients to ``None`` (what was carried stays set aside)."""
        self.buffers.clear()
        for p in self.params:
            p.grad = None
        for forget in self.on_restart:
            forget()

    def close(self) -> None:
        self.merge()
        for handle in self.handles:
            handle.remove()
        for patch in reversed(self.patches):
            patch.undo()


def _reset_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Drop the GradScaler's per-optimizer stage (after ``unscale_`` in a failed attempt).

    GradScaler has no public way to do this; ``update()`` does the same for every optimizer.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, dict):
        states.pop(id(optimizer), None)
