"""An unwatched attempt (a whole batch on the fast path): what it can tell cheaply, and the
rule for retrying after an OOM inside an optimizer's first step.

A batch that runs whole is not watched by the ledger (:mod:`._ledger`): that would cost every
step. What such an attempt knows instead: the optimizer steps that began (one process-wide
pre-hook), the parameters' version counters, and copies of the state the step is known to
change before its optimizer step (:class:`_Known`, learned from the ledger's watched
attempts: BatchNorm statistics, metric states, other tensors the step wrote), put back after
a failure.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.hooks import RemovableHandle

from autobatch._errors import AutobatchError
from autobatch._memory._backends import restore_rng_states, save_rng_states
from autobatch._oom import MAX_CHAIN_DEPTH
from autobatch._recovery import _inspect
from autobatch._recovery._backups import Backups, Slot, _Kept, put_scalars
from autobatch._recovery._patches import backward_handler
from autobatch._recovery._rules import Kind, Seen

_VERSION = operator.attrgetter("_version")  # a tensor's in-place modification counter
_GRAD = operator.attrgetter("grad")
_DEREF = weakref.ref.__call__  # (mapped over weak references: their objects, or None)


@dataclass(frozen=True)
class _Failure:
    exc: BaseException  # traceback stripped from every link: holds no frame, so no tensor
    kind: str
    inside: torch.optim.Optimizer | None  # the optimizer whose step() was running, if any
    unallocated: float | None = None  # the share of reserved memory cached but unallocated


def _strip_tracebacks(exc: BaseException) -> None:
    """Drop the traceback of every link of the chain: frames (and their tensors) can then die."""
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < MAX_CHAIN_DEPTH:
        link = stack.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        stack.extend(x for x in (link.__cause__, link.__context__) if x is not None)


def _optimizer_in_traceback(exc: BaseException) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step`` was on the stack when ``exc`` was raised, if any."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer):
                return owner
        tb = tb.tb_next
    return None


_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "autobatch_attempt", default=None
)


def current() -> _Attempt | None:
    """The fast path's attempt running in this context, if any."""
    return _ATTEMPT.get()


# What a step is known to touch ------------------------------------------------------------


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is ``torch.compile``d."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


# Structure: what was registered since ----------------------------------------------------------

_EPOCH = [0]
_registration_hooks: list[RemovableHandle] = []
#: The modules of every step as its last watched call saw them (a registration into one of
#: them changes what its step may write; a module made inside a step, a loss, does not).
_WATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


#: Told of each registration into a step's modules before it happens, with what puts back
#: what it replaces (the ledger: it refuses one in a micro-batch before the last outside every
#: forward, and keeps the undo in its stores).
REGISTERING: list[Callable[[nn.Module, str, Any], None]] = []
_NEW = object()


def _registered(module: nn.Module, name: str, value: Any) -> None:
    if torch.compiler.is_compiling() or module not in _WATCHED:
        return  # (compiled code is copied whole before each attempt: see _Known)
    before: Any = (module, name, _NEW)
    for held in (module._buffers, module._modules, module._parameters):
        if name in held:
            if held[name] is value:
                return  # (the same object again: ``self.count += 1`` on a buffer re-registers it)
            before = (held, name, held[name])
    for judge in REGISTERING:
        judge(module, name, before)
    attempt = _ATTEMPT.get()
    if attempt is not None:  # (a failed attempt puts the object back: ``self.n = self.n + 1``)
        attempt.undo.keep(("registered", id(before[0]), name), before, put_registered)
    _EPOCH[0] += 1


def put_registered(before: tuple[Any, str, Any]) -> None:
    """Put back what a registration replaced (or drop what it added)."""
    holder, name, value = before
    if value is _NEW:
        for held in (holder._buffers, holder._modules, holder._parameters):
            held.pop(name, None)
    else:
        holder[name] = value


def watch_structure(modules: Iterable[nn.Module]) -> None:
    """Count registrations into these modules and their submodules from now on."""
    for top in modules:
        for module in top.modules():
            _WATCHED.add(module)


def structure_epoch() -> int:
    """A count of the modules, parameters and buffers registered into the steps' modules
    (``register_buffer``, a buffer or submodule assigned, a new head): a step whose modules
    changed since its last watched call is watched again (state first written on a later
    call). Counted by torch's global registration hooks, installed once."""
    if not _registration_hooks:
        _registration_hooks.extend((
            register_module_buffer_registration_hook(_registered),
            register_module_module_registration_hook(_registered),
            register_module_parameter_registration_hook(_registered),
        ))
    return _EPOCH[0]


class _Known:
    """What a step is known to touch: the modules it runs (``model=``, modules its code names,
    modules seen running in watched attempts) and their parameters, the optimizers'
    parameters, and the state the ledger saw it change before its optimizer step (module
    buffers, metric states, other tensors), copied before every unwatched attempt in one
    fused copy, so that a failed one can be undone."""

    def __init__(
        self, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
    ) -> None:
        self.modules: list[nn.Module] = []
        self.module_ids: set[int] = set()
        self.params: list[torch.Tensor] = []
        self.param_ids: set[int] = set()
        self.changing: list[torch.Tensor] = []  # copied before each unwatched attempt
        self.changing_keys: set[int] = set()
        self.shadows: list[torch.Tensor] = []
        self.metrics: list[nn.Module] = []
        self.writes_batch = False  # the step writes its batch in place
        self.writes_params = False  # it changes parameters outside its optimizer step
        self.carries = False  # gradients are left for the next call to add to
        #: calls in a row whose backward found none of the gradients carried into the call
        #: (a step that zeroes them with set_to_none first): from 3 on, none are kept apart
        self.drops_first = 0
        self.compiled = False
        self.host_rng = False  # it draws from Python's or NumPy's stream: saved with torch's
        self.graphless = True  # nothing in `changing` requires gradients
        for optimizer in optimizers:
            self._add_params(p for g in optimizer.param_groups for p in g["params"])
        for module in modules:
            self.add_module(module)

    @property
    def plain(self) -> bool:
        """Whether the step is known to change nothing an unwatched attempt must copy or count."""
        return not (
            self.changing or self.metrics or self.writes_params or self.writes_batch
            or self.carries
        )

    def add_params(self, params: Iterable[torch.Tensor]) -> None:
        """Watch these parameters too (found receiving gradients outside the known modules)."""
        self._add_params(params)

    def _add_params(self, params: Iterable[torch.Tensor]) -> None:
        added = [p for p in params if id(p) not in self.param_ids]
        if added:
            self.params = self.params + added  # a new list: attempts keep the one they began with
            self.param_ids.update(id(p) for p in added)

    def refresh(self) -> None:
        """Look at the known modules again (a submodule, a metric, added since), and learn
        anew what the step changes (a replaced buffer is no longer copied)."""
        self.changing, self.changing_keys, self.shadows = [], set(), []
        for module in self.modules:
            self._add_params(module.parameters())
            self.compiled = self.compiled or _is_compiled(module)
            self.metrics += [m for m in module.modules() if _inspect._is_metric(m)
                             and all(m is not k for k in self.metrics)]

    def add_module(self, module: nn.Module) -> None:
        if id(module) in self.module_ids:
            return
        self.module_ids.add(id(module))
        self.modules.append(module)
        self._add_params(module.parameters())
        self.compiled = self.compiled or _is_compiled(module)
        self.metrics += [m for m in module.modules() if _inspect._is_metric(m)
                         and all(m is not k for k in self.metrics)]

    def learn(self, written: list[tuple[Kind, torch.Tensor]]) -> None:
        """Copy from now on what a watched attempt saw written before its optimizer step."""
        added = False
        for kind, tensor in written:
            if kind is Kind.BATCH:
                self.writes_batch = True
                continue
            if kind in (Kind.PARAMETER, Kind.OPTIMIZER):
                self.writes_params = True
                continue
            if kind is Kind.METRIC:
                continue  # (metric states are saved whole)
            key = _inspect._key(tensor)
            if key in self.changing_keys or tensor.is_sparse:
                continue
            self.changing_keys.add(key)
            self.changing.append(tensor)
            added = True
        if added:
            with torch.no_grad(), _inspect.engine_work():
                self.shadows = [torch.empty_like(t) for t in self.changing]
            self.graphless = not any(t.requires_grad for t in self.changing)

    def save(self) -> _Shadows | None:
        """Copy what is known to change into its shadows; ``None`` when there is nothing.

        On every unwatched attempt, so kept cheap: one fused copy, entered into ``no_grad``
        only for state that requires gradients and out of dispatch modes only where one is on
        (each costs more than the copy of a few BatchNorm buffers)."""
        if not self.changing and not self.metrics:
            return None
        if self.changing:
            if self.graphless and not torch._C._len_torch_dispatch_stack():
                torch._foreach_copy_(self.shadows, self.changing)
            else:
                with torch.no_grad(), _disable_current_modes():  # (allocates nothing)
                    torch._foreach_copy_(self.shadows, self.changing)
        metrics = [_inspect._metric_state(m) for m in self.metrics]
        return self.changing, self.shadows, metrics

    @staticmethod
    def restore(saved: _Shadows) -> None:
        changing, shadows, metrics = saved
        if changing:
            with torch.no_grad(), _disable_current_modes():
                torch._foreach_copy_(changing, shadows)
        for metric in metrics:
            _inspect._put_metric(metric)


_Shadows = tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]


def _put_gradients(saved: tuple[list[torch.Tensor], list[Any]]) -> None:
    """Every gradient as an attempt began (held weakly; ``None`` stays ``None``)."""
    params, grads = saved
    for p, ref in zip(params, grads, strict=True):
        grad = None if ref is None else ref()  # (None: the step dropped it itself)
        if p.grad is not grad:
            p.grad = grad
_NOTHING: list[Any] = []  # (shared, never appended to)
_NONES = itertools.repeat(None)


class _Host(Protocol):
    """What an attempt needs of the engine that runs it."""

    name: str
    optimizers: tuple[torch.optim.Optimizer, ...]
    optimized_ids: set[int]  # the parameters the step's own optimizers update
    known: _Known
    embeds: bool  # the step calls embed_in_pieces
    scalars: list[Slot]  # where the step keeps Python scalars of its own


def _carrying_backward(
    real: Callable[..., Any], tensors: Any, *args: Any,
    carried: list[tuple[torch.Tensor, weakref.ref[torch.Tensor]]], carried_into: list[bool],
    **kwargs: Any,
) -> Any:
    """``torch.autograd.backward`` for a step that adds to gradients carried from earlier
    calls: the carried ones are set aside while backward runs and the new ones added to them
    in place afterwards (the same addition autograd makes), so that a backward that runs out
    of memory leaves them untouched."""
    if torch._C._current_autograd_node() is not None:
        return real(tensors, *args, **kwargs)
    aside = [(p, g) for p, ref in carried if (g := ref()) is not None and p.grad is g]
    if aside:
        carried_into.append(True)
    for p, _ in aside:
        p.grad = None
    try:
        result = real(tensors, *args, **kwargs)
    except BaseException:
        for p, g in aside:
            p.grad = g
        raise
    strided: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    with torch.no_grad():
        for p, g in aside:
            new = p.grad
            if new is None:
                p.grad = g
            elif g.layout == torch.strided and new.layout == torch.strided:
                strided[0].append(g)
                strided[1].append(new)
                p.grad = g
            else:
                p.grad = g + new
        if strided[0]:  # (one fused addition, as autograd's in-place accumulation)
            torch._foreach_add_(*strided)
    return result


def _zeroed(grad: torch.Tensor) -> bool:
    """Whether a gradient carried into an attempt was zeroed in place by it (``zero_grad(
    set_to_none=False)`` at the start of the step): the retry zeroes it again, so nothing of
    its old value counts (read after a failure only)."""
    with torch.no_grad(), _disable_current_modes():
        return grad.layout == torch.strided and not bool(grad.any())


def kept_by(attempt: _Attempt | None) -> set[int] | None:
    """What a failed unwatched attempt copied (:meth:`_Attempt.kept`); ``None`` without one."""
    return None if attempt is None else attempt.kept()


class _Attempt:
    """One unwatched run of a step function (a whole batch): the optimizer steps that began,
    the parameters' version counters, the known-changing state copied before it, and, for a
    step that adds to gradients carried from earlier calls, those gradients kept apart from
    its backward (:func:`_carrying_backward`)."""

    __slots__ = (
        "apart",
        "batch_versions",
        "carried",
        "carried_into",
        "carried_refs",
        "engine",
        "firsts",
        "light",
        "ours_stepped",
        "params",
        "patch",
        "scalars",
        "stepped",
        "token",
        "undo",
        "versions",
        "versions_carried",
        "zeroed",
    )

    def __init__(
        self, engine: _Host, batch: list[torch.Tensor] | None = None, *, carry: bool = True
    ) -> None:
        # On every step of the fast path: what a step not known to change anything (the
        # common case) needs is set in a few assignments, the rest only where it is known.
        known = engine.known
        self.engine = engine
        self.stepped: list[torch.optim.Optimizer] = []
        self.ours_stepped = False
        self.firsts: dict[int, list[tuple[torch.Tensor, int]]] | None = None
        self.patch: Any = None
        self.token: contextvars.Token[_Attempt | None] | None = None
        self.zeroed = False  # it zeroed carried gradients in place (their values are gone)
        self.scalars: list[Any] | None = None  # the step's Python scalars as it began
        self.began_with(known.params, carry=carry)
        #: made for a step known to change nothing: nothing copied (the engine may reuse it)
        self.light = known.plain
        if self.light:
            self.versions = self.batch_versions = None
            return
        # the parameters' versions, where the step is known to change them outside its
        # optimizer step (an EMA before it); each first step records its own (optimizer_stepping)
        self.versions = list(map(_VERSION, known.params)) if known.writes_params else None
        saved = known.save()
        if saved is not None:
            self.undo.keep("known", saved, _Known.restore)
        self.batch_versions = (
            [(t, t._version) for t in batch] if batch is not None and known.writes_batch else None
        )

    def began_with(self, params: list[torch.Tensor], *, carry: bool = True) -> None:
        """Note the gradients as the attempt begins, weakly (a step that zeroes them first
        frees them, as it would unguarded): a failed attempt puts them back, and ``None``
        stays ``None``. Those already there are carried, kept apart from its backward
        (``carry``; not under a process group, whose backward reduces what ``.grad`` holds,
        unless the step is known to carry gradients across calls)."""
        self.params = params
        self.undo = undo = Backups()
        # the random streams (a dropout mask drawn before memory ran out is drawn again)
        undo.entries["rng"] = _Kept(restore_rng_states, save_rng_states(
            host=self.engine.known.host_rng))
        grads = [p.grad for p in params]
        for g in grads:  # (a plain loop: the common case has none, on every step)
            if g is not None:
                break
        else:
            undo.entries["gradients"] = _Kept(_put_gradients, (params, grads))
            self.carried = self.carried_refs = self.versions_carried = _NOTHING
            self.apart = False
            return
        undo.keep("gradients", (params, [
            None if g is None else weakref.ref(g) for g in grads]), _put_gradients)
        known = self.engine.known
        if not (carry or known.carries):
            self.carried = self.carried_refs = self.versions_carried = _NOTHING
            self.apart = False
            return
        self.carried = [p for p, g in zip(params, grads, strict=True) if g is not None]
        self.carried_refs = [weakref.ref(g) for g in grads if g is not None]
        self.versions_carried = [g._version for g in grads if g is not None]
        self.apart = known.carries or known.drops_first < 3

    def again(self, params: list[torch.Tensor]) -> None:
        """Begin anew, for the fast path's next call: a light attempt (nothing copied) that
        ended well, where every parameter has a gradient (the common case, read in a few C
        calls: this runs on every step), else as :meth:`began_with` does."""
        if self.stepped:
            self.stepped = []
        self.ours_stepped = False
        self.firsts = None
        grads = list(map(_GRAD, params))
        try:
            refs = list(map(weakref.ref, grads))
        except TypeError:  # (a gradient is None)
            self.began_with(params)
            return
        if len(self.undo.entries) > 2:  # (it kept what a registration replaced: anew)
            self.began_with(params)
            return
        self.params = params
        kept, rng = self.undo.entries["gradients"], self.undo.entries["rng"]
        assert isinstance(kept, _Kept)  # (a light attempt keeps nothing else)
        assert isinstance(rng, _Kept)
        kept.value = (params, refs)
        rng.value = save_rng_states(host=self.engine.known.host_rng)
        self.carried, self.carried_refs = params, refs
        self.versions_carried = list(map(_VERSION, grads))
        self.apart = self.engine.known.drops_first < 3  # (a light attempt's step carries none)

    def __enter__(self) -> _Attempt:
        self.token = _ATTEMPT.set(self)
        if self.apart:
            self.keep_carried()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end(self.token)
        self.token = None

    def keep_carried(self) -> None:
        """Keep the gradients carried from earlier calls apart from the attempt's backward."""
        self.carried_into: list[bool] = []
        self.patch = backward_handler(functools.partial(
            _carrying_backward, carried=list(zip(self.carried, self.carried_refs, strict=True)),
            carried_into=self.carried_into))
        self.patch.__enter__()

    def end(self, token: contextvars.Token[_Attempt | None] | None) -> None:
        """The attempt is over: no longer the current one (``token``: what made it so), and
        autograd's backward is its own again."""
        if token is not None:
            _ATTEMPT.reset(token)
        if self.patch is not None:
            self.patch.__exit__(None, None, None)
            self.patch = None
            known = self.engine.known
            known.drops_first = 0 if self.carried_into else known.drops_first + 1

    def ended_well(self) -> None:
        """The attempt returned without keeping the carried gradients apart (its step dropped
        them first in the calls before): where it added to one all the same, they are kept
        apart again from the next call on."""
        if self.apart or not any(map(operator.is_not, map(_DEREF, self.carried_refs), _NONES)):
            return  # (the common case, in C: every carried gradient was dropped and freed)
        for p, ref, version in zip(
            self.carried, self.carried_refs, self.versions_carried, strict=True
        ):
            grad = ref()
            if grad is not None and grad._version != version and p.grad is grad:
                self.engine.known.drops_first = 0
                return

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> None:
        self.stepped.append(optimizer)
        if not self.ours_stepped and optimizer in self.engine.optimizers:  # (by identity)
            self.ours_stepped = True
        if not optimizer.state:  # its first step: the parameters' versions before it
            firsts = self.firsts
            if firsts is None:
                firsts = self.firsts = {}
            if id(optimizer) not in firsts:
                firsts[id(optimizer)] = [
                    (p, p._version) for g in optimizer.param_groups for p in g["params"]
                ]

    def _began(self, p: torch.Tensor) -> int | None:
        """``p``'s version as the attempt began, where it was recorded."""
        if self.versions is None:
            return None
        for q, version in zip(self.params, self.versions, strict=False):
            if q is p:
                return int(version)
        return None

    def changed(self) -> list[torch.Tensor]:
        """The parameters changed in place since the attempt began (known where the step is
        known to change them outside its optimizer step, else those of first steps)."""
        if self.versions is not None:
            return [
                p for p, version in zip(self.params, self.versions, strict=True)
                if p._version != version
            ]
        firsts = self.firsts or {}
        return [p for first in firsts.values() for p, v in first if p._version != v]

    def rollback(self) -> None:
        """Put back what the attempt's undo store holds: the known-changing state as it was
        when the attempt began, and every gradient as it was (the failed attempt's own are
        dropped; ``None`` stays ``None``), and the step's Python scalars (a call counter)."""
        self.undo.put_back()
        if self.scalars is not None:
            put_scalars(self.engine.scalars, self.scalars)

    def rewind_rng(self) -> None:
        """The random streams as the attempt began (also where a refusal leaves the rest as it
        is: a step run again draws what it drew)."""
        kept = self.undo.entries["rng"]
        assert isinstance(kept, _Kept)
        kept.put(kept.value)

    def kept(self) -> set[int]:
        """The storages of the state this attempt copied before it ran (put back after it
        failed): what the ledger need not refuse when the batch runs again."""
        kept: set[int] = set()
        saved = self.undo.entries.get("known")  # (what it copied as it began)
        if isinstance(saved, _Kept):
            changing, _, metrics = saved.value
            kept.update(_inspect._key(t) for t in changing)
            for metric, states, _ in metrics:
                kept.update(_inspect._key(t) for name in states
                            if isinstance(t := getattr(metric, name, None), torch.Tensor))
        if self.batch_versions is not None:
            kept.update(_inspect._key(t) for t, _ in self.batch_versions)
        return kept

    def explain(self, error: BaseException) -> None:
        """Say in a refusal of the batch this attempt began what it could not put back."""
        if not isinstance(error, AutobatchError) or not error.args:
            return
        kept = self.undo.entries.get("gradients")
        refs = kept.value[1] if isinstance(kept, _Kept) else ()
        dropped = any(ref is not None and ref() is None for ref in refs)
        for lost, what in ((self.zeroed, "zeroed in place (zero_grad(set_to_none=False))"),
                           (dropped, "dropped (zero_grad() at its start)")):
            if lost:  # (their old values were never copied: the fast path is cheap)
                message = str(error.args[0]).replace("nothing of it", "nothing else of it")
                end = "" if message.rstrip().endswith(".") else "."
                error.args = (
                    f"{message}{end} The gradients from before the call, which the step {what} "
                    "before the whole batch ran out of memory, are not put back.",
                    *error.args[1:])

    def seen(self, describe: Callable[[list[torch.Tensor]], str]) -> Seen:
        """What the failed attempt did that :meth:`rollback` does not undo, for the judge
        (:func:`._rules.judge`): the optimizer steps that began, the parameters changed (by
        their version counters), the batch, the carried gradients."""
        optimized = self.engine.optimized_ids
        batch = self.batch_versions is not None and any(
            t._version != v for t, v in self.batch_versions
        )
        carried = False
        for ref, version in zip(self.carried_refs, self.versions_carried, strict=True):
            grad = ref()
            if grad is None or grad._version == version:
                continue
            if _zeroed(grad):
                self.zeroed = True  # (zero_grad(set_to_none=False) first: the retry zeroes it)
                continue
            carried = True
        if carried and not self.apart:  # (a step that dropped them first stopped doing so)
            self.engine.known.drops_first = 0
        changed = self.changed()
        foreign = [p for p in changed if id(p) not in optimized]
        # parameters changed before any optimizer step began (Embedding(max_norm=) renormalises
        # its weight in forward): not the optimizer's doing, whatever failed after
        at_step = {id(p): v for first in (self.firsts or {}).values() for p, v in first}
        before = [] if self.versions is None else [  # (else `changed` are a first step's)
            p for p in changed
            if (at_step[id(p)] != self._began(p) if id(p) in at_step else not self.stepped)
        ]
        n = len(changed)
        return Seen(
            stepped=list(self.stepped), fresh=set(self.firsts or ()),
            changed=f"{n} of its parameters ({describe(changed)})" if changed else "",
            foreign=describe(foreign) if foreign else "",
            before=describe(before) if before else "", batch=batch, carried=carried,
        )
