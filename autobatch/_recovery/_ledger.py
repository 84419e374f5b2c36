"""The write ledger: every change a watched attempt of a step makes to state that existed
before it, and whether the batch can then be replayed exactly.

While a batch runs in micro-batches (and on a step's first call, and under a process group),
each attempt runs under :class:`_Mode`, a ``TorchDispatchMode`` that sees every operator the
step dispatches, on autograd's threads too (torch hands the mode to backward). An operator's
schema says which arguments it writes (``Tensor(a!)``), and
:data:`autobatch._memory._accounting.HIDDEN_WRITES` the few that write without saying so (batch norm's
running statistics). A write to a tensor created during the attempt is the step's own
business; a write to one that existed before it is looked up in the ledger's index (the
model's parameters and buffers, gradients, optimizer state, metric states, tensors declared
additive, the batch) and judged by the rule of its kind (:data:`._rules.RULES`).

Other changes are seen at the edges of an attempt (:data:`._rules.CHECKS`): a ``.grad`` assigned, a
changed optimizer hyperparameter (an LR scheduler not given). Optimizer steps are seen by one
process-wide pre-hook (:func:`see_optimizer_steps`), for the ledger and for the fast path's
attempts alike. After a refusal, or any error other than an out-of-memory one, the batch is
undone: the state is as it was before the call. A step that runs whole and does not run out
of memory is never watched (see :mod:`._attempt` for its cheaper checks).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from autobatch._memory._accounting import (
    DispatchMode,
    OpFacts,
    _tensors,
    call_keeping_versions,
    op_facts,
    written_tensors,
)
from autobatch._memory._backends import host_rng_moved, restore_rng_states, save_rng_states
from autobatch._recovery import _attempt
from autobatch._recovery._backups import Backups, _Kept
from autobatch._recovery._inspect import (
    _BUSY,
    _compiled,
    _forward_module,
    _from_distributed,
    _hyperparameters,
    _is_metric,
    _key,
    _metric_state,
    _put_metric,
    _search,
    leaves,
    user_frame,
)
from autobatch._recovery._patches import backward_handler, running_split
from autobatch._recovery._rows import RowWatch
from autobatch._recovery._rules import (
    CHECKS,
    RULES,
    Edge,
    Kind,
    Seen,
    Verdict,
    Write,
    _describe,
    assigned_early,
    refusal,
    unseen_write,
)

#: Kinds of state a failed unwatched attempt may have changed without a copy to put back.
_UNSEEN_KINDS = frozenset({Kind.BUFFER, Kind.ADDITIVE, Kind.OTHER, Kind.BATCH, Kind.METRIC})

#: Ledgers watching an attempt now, by thread, innermost last.
_WATCHING: dict[int, list[Ledger]] = {}


def _watch(ledger: Ledger) -> None:
    _WATCHING.setdefault(threading.get_ident(), []).append(ledger)


def _unwatch(ledger: Ledger) -> None:
    thread = threading.get_ident()
    mine = _WATCHING.get(thread, [])
    if ledger in mine:
        mine.remove(ledger)
    if not mine:
        _WATCHING.pop(thread, None)


def watching() -> Ledger | None:
    """The innermost ledger watching an attempt of this thread's step, if any. On a thread of
    autograd's own (a device's backward: not started from Python), where no step runs, the
    one ledger watching in the process, if there is exactly one (with two, whose backward it
    is cannot be told). A thread of the user's never sees another thread's ledger: a CPU
    backward runs on the thread that called it."""
    mine = _WATCHING.get(threading.get_ident())
    if mine:
        return mine[-1]
    if len(_WATCHING) == 1 and torch._C._current_autograd_node() is not None and isinstance(
        threading.current_thread(), threading._DummyThread
    ):
        (only,) = _WATCHING.values()
        return only[-1] if only else None
    return None



# Optimizer steps, seen process-wide ------------------------------------------------------------

_step_hook: RemovableHandle | None = None


def see_optimizer_steps() -> None:
    """Install, once per process, the hook through which ledgers and the fast path's attempts
    see every optimizer step begin (a list and a context-variable read per ``step()``)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_optimizer_stepping)


def _registering(module: nn.Module, name: str, before: Any) -> None:
    """A buffer, parameter or submodule assigned into one of a step's modules (another object
    than it held): refused in a micro-batch before the last outside every forward
    (:func:`._rules.assigned_early`); otherwise kept, to be put back with the piece or batch."""
    ledger = watching()
    if ledger is None:
        return
    if ledger.early and ledger.records and _forward_module() is None:
        raise assigned_early(ledger.host.name, type(module).__name__, name)
    if ledger.is_open:  # (self.n = self.n + 1 on a buffer, in a forward)
        key = ("registered", id(before[0]), name)
        ledger.piece.keep(key, before, _attempt.put_registered)
        ledger.batch.keep(key, before, _attempt.put_registered)


_attempt.REGISTERING.append(_registering)


def _optimizer_stepping(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    ledger = watching()
    if ledger is not None:
        ledger.optimizer_stepping(optimizer)
    attempt = _attempt.current()
    if attempt is not None:
        attempt.optimizer_stepping(optimizer)


class _Host(Protocol):
    """What the ledger needs of the engine whose attempts it watches."""

    name: str
    optimizers: tuple[torch.optim.Optimizer, ...]
    schedulers: tuple[Any, ...]
    additive: tuple[torch.Tensor, ...]
    embeds: bool

    def modules_known(self) -> list[nn.Module]: ...

    def named_modules_known(self) -> list[tuple[str, nn.Module]]: ...

    def params_known(self) -> list[torch.Tensor]: ...


# The dispatch mode ------------------------------------------------------------------------------


class _Mode(DispatchMode):
    """Hands every write and every new storage of a watched attempt to its ledger, and every
    collective to its gate.

    Code compiled with ``torch.compile`` runs compiled under it (``ignore_compile_internals``):
    dynamo would otherwise run a frame first seen under a mode eagerly from then on. What
    compiled code writes is therefore not seen; the ledger copies the buffers of compiled
    modules before each attempt instead.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # (every operator of a watched attempt comes here: kept short, one dict lookup)
        kwargs = kwargs or {}
        facts = _FACTS.get(func)
        if facts is None:
            facts = _FACTS[func] = op_facts(func)
        if _BUSY.depth:
            return _call(facts, func, args, kwargs)
        ledger = self.ledger
        if ledger.gate is not None:
            if facts.collective or ledger.distributes(args):
                ledger.gate(func, ledger.allocated)
                ledger.allocated = False
            elif facts.fresh:
                ledger.allocated = True
        if not ledger.records:
            out = _call(facts, func, args, kwargs)
            if ledger.rows is not None and torch._C._current_autograd_node() is None:
                ledger.rows.see(func, args, kwargs, out)  # (a later piece's rows, followed)
            return out
        if facts.writes:
            written = written_tensors(facts, args, kwargs)
            if ledger.sums and ledger.early and ledger.drops(written, facts.name):
                # (a write to the gradient sum shown in an early piece: the last piece makes
                # it on the whole batch's gradient, once)
                return None if facts.foreach_write else written[0]
            for tensor in written:
                ledger.writing(tensor, facts.name)
        if facts.writes and ledger.stepping:
            out = _call(facts, func, args, kwargs)
            ledger.wrote_in_step = True  # (once it ran: one that ran out of memory wrote nothing)
            return out
        out = _call(facts, func, args, kwargs)
        if facts.fresh:
            if type(out) is torch.Tensor and out.layout is torch.strided:
                ledger.fresh.add(out.untyped_storage()._cdata)
            else:
                for tensor in _tensors((out,)):
                    ledger.fresh.add(_key(tensor))
        if ledger.rows is not None and torch._C._current_autograd_node() is None:
            ledger.rows.see(func, args, kwargs, out)  # (the forward's: backward's are not)
        return out


_FACTS: dict[Any, OpFacts] = {}


def _call(facts: OpFacts, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an operator; a ``_foreach_`` one that writes has its version counters kept as
    outside a mode (:func:`autobatch._memory._accounting.call_keeping_versions`)."""
    if facts.foreach_write:
        return call_keeping_versions(func, args, kwargs)
    return func(*args, **kwargs)


def _discovering(real: Callable[..., Any], tensors: Any, *args: Any, ledger: Ledger,
                 **kwargs: Any) -> Any:
    """``torch.autograd.backward`` in a watched whole attempt: the parameters outside the
    known modules that receive gradients are found first (then indexed, and known to the fast
    path), and the backward runs as it is."""
    if torch._C._current_autograd_node() is None and watching() is ledger:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        found = [p for p in leaves(t for t in roots if isinstance(t, torch.Tensor))
                 if isinstance(p, nn.Parameter) and _key(p) not in ledger.index]
        if found:
            ledger.adopt(found)
            ledger.adopted += found
    return real(tensors, *args, **kwargs)


def _put_gradient(saved: tuple[torch.Tensor, weakref.ref[torch.Tensor] | None]) -> None:
    p, ref = saved
    p.grad = None if ref is None else ref()  # (None: the step set it to None itself)


def _put_hyper(saved: tuple[torch.optim.Optimizer, list[dict[str, Any]]]) -> None:
    optimizer, groups = saved
    del optimizer.param_groups[len(groups):]  # (groups the step added: add_param_group)
    for group, hyper in zip(optimizer.param_groups, groups, strict=False):
        group.update(hyper)


# The ledger -----------------------------------------------------------------------------------


class Ledger:
    """The writes of one engine's watched attempts, its backups, and the verdicts.

    A batch on the slow path: :meth:`open` (builds the index of what exists), then one
    :meth:`attempt` per piece, :meth:`check_piece` after a piece that succeeded,
    :meth:`undo_piece` / :meth:`undo_batch` after one that failed, :meth:`close` at the end.
    """

    def __init__(self, host: _Host) -> None:
        self.host = host
        self.index: dict[int, tuple[Kind, str]] = {}
        self.fresh: set[int] = set()
        self.records = False  # writes are recorded (else only collectives are gated)
        self.gate: Callable[[Any, bool], None] | None = None
        self.allocated = True  # an operator allocated since the gate last ran
        self.early = False
        self.split = False
        self.stepping = False  # inside the real step of one of the step's optimizers
        self.stepped = False  # such a step began in this attempt
        self.wrote_in_step = False  # it wrote the parameters or its state
        self.began: list[torch.optim.Optimizer] = []  # every optimizer step that began
        self.firsts: set[int] = set()  # those that were their optimizer's first
        self.step_versions: list[tuple[torch.Tensor, int]] = []
        self.sums: set[int] = set()  # the gradient sums an early piece shows (writes dropped)
        self.piece = Backups()
        self.batch = Backups()
        self.metrics: list[nn.Module] = []
        self.hyper: list[list[dict[str, Any]]] = []
        # the gradients there were when the batch began, held weakly: a step that zeroes its
        # gradients first frees them, as it would unsplit (one gradient's worth of memory)
        self.carried: list[tuple[torch.Tensor, weakref.ref[torch.Tensor] | None]] = []
        self.learned: list[tuple[Kind, torch.Tensor]] = []  # written before a step, for the fast path
        self.params: list[torch.Tensor] = []
        self.opaque: list[torch.Tensor] = []  # buffers of compiled modules
        self.adopted: list[torch.Tensor] = []  # parameters found outside the known modules
        #: the batch's first attempt ran whole, unwatched, and failed: the storages it put back
        self.unwatched: set[int] | None = None
        self._norms: dict[int, nn.Module] = {}  # BatchNorm layers seen updating statistics
        self.rows: RowWatch | None = None  # the micro-batch's rows, followed (a split's early piece)
        self._is_open = False

    # The batch --------------------------------------------------------------------------------

    def open(
        self, batch_tensors: Iterable[torch.Tensor], *, split: bool, unwatched: set[int] | None = None
    ) -> None:
        """A batch begins on the slow path: index what exists now, and save what a restart
        puts back (gradients, hyperparameters, metric states, RNG). ``unwatched``: its whole
        attempt failed unwatched, having copied these storages."""
        self._is_open = True
        self.unwatched = unwatched
        self.split = split
        index: dict[int, tuple[Kind, str]] = {}
        host = self.host
        params: dict[int, torch.Tensor] = {}
        p: torch.Tensor
        names: dict[int, str] = {}
        metrics: dict[int, nn.Module] = {}
        opaque: dict[int, torch.Tensor] = {}
        for prefix, module in host.named_modules_known():
            for path, sub in module.named_modules(prefix=prefix):
                if _is_metric(sub):
                    metrics[id(sub)] = sub
                    names.setdefault(id(sub), path)
                if _compiled(sub):
                    opaque.update((id(b), b) for b in sub.buffers() if b is not None)
            for name, p in module.named_parameters():
                params.setdefault(id(p), p)
                names.setdefault(id(p), f"{prefix}.{name}")
            for name, b in module.named_buffers():
                for t in _tensors((b,)):
                    index.setdefault(_key(t), (Kind.BUFFER, f"{prefix}.{name}"))
        self.opaque = list(opaque.values())
        for optimizer in host.optimizers:
            label = type(optimizer).__name__
            for group in optimizer.param_groups:
                for p in group["params"]:
                    params.setdefault(id(p), p)
                    names.setdefault(id(p), f"a parameter of {label}")
                for key, value in group.items():
                    if isinstance(value, torch.Tensor):
                        index[_key(value)] = (Kind.OPTIMIZER, f"{label} param_groups[...][{key!r}]")
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    for t in _tensors((value,)):
                        index[_key(t)] = (Kind.OPTIMIZER, f"{label}.state[{names.get(id(p), 'p')}][{key!r}]")
        for p in host.params_known():  # (parameters found outside the modules: a temperature)
            params.setdefault(id(p), p)
        self.params = list(params.values())
        self.carried = []
        for p in self.params:
            name = names.get(id(p), "a parameter")
            for t in _tensors((p,)):
                index[_key(t)] = (Kind.PARAMETER, name)
            self.carried.append((p, None if p.grad is None else weakref.ref(p.grad)))
            if p.grad is not None:
                for t in _tensors((p.grad,)):
                    index[_key(t)] = (Kind.GRADIENT, f"{name}.grad")
        self.metrics = list(metrics.values())
        for metric in self.metrics:
            for name in getattr(metric, "_defaults", {}):
                for t in _tensors((getattr(metric, name, None),)):
                    index[_key(t)] = (Kind.METRIC, f"{names.get(id(metric), 'a metric')}.{name}")
        for i, t in enumerate(host.additive):
            for inner in _tensors((t,)):
                index[_key(inner)] = (Kind.ADDITIVE, f"additive[{i}]")
        for t in batch_tensors:
            index.setdefault(_key(t), (Kind.BATCH, "the batch"))
        self.index = index
        self.hyper = [_hyperparameters(o) for o in host.optimizers]
        self.batch = Backups()
        for p, ref in self.carried:
            self.batch.keep(("gradient", id(p)), (p, ref), _put_gradient)
        for optimizer, groups in zip(host.optimizers, self.hyper, strict=True):
            self.batch.keep(("hyperparameters", id(optimizer)), (optimizer, groups), _put_hyper)
        self._keep_changing(self.batch)

    @property
    def batchnorms(self) -> list[nn.Module]:
        """The BatchNorm layers seen updating their statistics in watched attempts."""
        return list(self._norms.values())

    @property
    def is_open(self) -> bool:
        """Whether a batch is open (between :meth:`open` and :meth:`close`)."""
        return self._is_open

    def close(self) -> None:
        """The batch ended (done, or raised): forget its records."""
        self._is_open = False
        self.unwatched = None
        self.index = {}
        self.fresh = set()
        self.piece = Backups()
        self.batch = Backups()
        self.carried = []

    # One attempt ------------------------------------------------------------------------------

    @contextmanager
    def attempt(
        self,
        *,
        early: bool,
        split: bool = False,
        records: bool = True,
        gate: Callable[[Any, bool], None] | None = None,
        on_forward: Callable[[nn.Module, bool], None] | None = None,
        shadow: Iterable[torch.Tensor] = (),
        rows: RowWatch | None = None,
    ) -> Iterator[None]:
        """Watch one attempt: ``early``, a micro-batch before the last; ``records``, judge its
        writes (else only ``gate`` collectives); ``on_forward(module, entering)`` hears of
        every module's forward; ``rows``, follow the micro-batch's rows through its forward
        (with ``records``).

        Without ``records`` or a gate no mode is installed (the last micro-batch of a split
        batch, whose writes happen once per batch): what this batch's earlier micro-batches
        wrote, and the tensors in ``shadow``, are copied first instead, so that a failure is
        undone all the same."""
        self.early = early
        self.split = split
        self.records = records
        self.gate = gate
        self.rows = rows
        self.allocated = True
        self.stepping = self.stepped = self.wrote_in_step = False
        self.step_versions = []
        self.began, self.firsts = [], set()
        route = running_split() if split else None  # (the split batch's accumulation)
        self.sums = route.sum_keys if route is not None else set()
        self.fresh = set()
        self.piece = Backups()
        if self._is_open:
            self._keep_changing(self.piece)
        if records and self._is_open:
            for buffer in self.opaque:  # written by compiled code, where the mode cannot see
                self.writing(buffer, "a compiled module's forward", force=Kind.BUFFER)
        if not records and self._is_open:
            for tensor in [*self.batch.tensors(), *shadow, *self.opaque]:
                self._back_up(tensor)

        hooks = [] if on_forward is None else [  # (for the ranks' agreement only)
            register_module_forward_pre_hook(lambda module, args: on_forward(module, True)),
            register_module_forward_hook(
                lambda module, args, output: on_forward(module, False), always_call=True
            ),
        ]
        _watch(self)
        try:
            with (
                backward_handler(functools.partial(_discovering, ledger=self))
                if records and not split else nullcontext()  # (a session finds them itself)
            ), _Mode(self) if records or gate is not None or rows is not None else nullcontext():
                yield
        finally:
            _unwatch(self)
            for hook in hooks:
                hook.remove()
            self.gate = None
            self.rows = None
            self.records = False

    def drops(self, written: list[torch.Tensor], op: str) -> bool:
        """Whether an operator writes only gradient sums shown in an early piece (then it is
        not run); one that writes both those and other tensors is refused."""
        hits = sum(_key(t) in self.sums for t in written)
        if hits and hits != len(written):
            raise refusal(
                self.host.name, f"changed gradients and other tensors in one operator ({op})",
                user_frame(), "in a micro-batch before the last, gradients are sums so far",
                "change gradients between backward() and optimizer.step() on their own",
            )
        return bool(hits)

    def distributes(self, args: tuple[Any, ...]) -> bool:
        """Whether an operator takes a DTensor (outside an optimizer's step): DTensor may
        redistribute its arguments, a collective the mode cannot see from inside."""
        if self.stepping:
            return False
        return any(
            type(t) is not torch.Tensor and type(t) is not nn.Parameter
            and type(t).__name__ == "DTensor" for t in args if isinstance(t, torch.Tensor)
        )

    @contextmanager
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The real step of one of the step's own optimizers runs (deferred to the last piece)."""
        self.stepped = True
        self.step_versions += [
            (p, p._version) for g in optimizer.param_groups for p in g["params"]
        ]
        outer = self.stepping
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = outer

    def step_changed_parameters(self) -> bool:
        """Whether an optimizer step of this attempt wrote a parameter (seen by the mode, or
        by the version counters where compiled code wrote it)."""
        return self.wrote_in_step or any(p._version != v for p, v in self.step_versions)

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's step begins (the process-wide pre-hook): one the step was not
        given is refused in a split batch before it changes anything."""
        self.began.append(optimizer)
        if not optimizer.state:
            self.firsts.add(id(optimizer))
        if any(optimizer is o for o in self.host.optimizers):
            self.stepped = True
            return
        label = type(optimizer).__name__
        if self.split:
            raise refusal(
                self.host.name,
                f"called {label}.step(), an optimizer autobatch was not given",
                user_frame(),
                "that optimizer would step once per micro-batch instead of once per batch",
                "pass every optimizer the step calls, retry_on_oom(optimizer=[opt_a, opt_b]); "
                "where one optimizer's step feeds the next part of the step (a GAN's "
                "discriminator, then its generator), decorate each part as its own function; "
                "or use policy='shrink'",
            )

    def writing(self, tensor: torch.Tensor, op: str, force: Kind | None = None) -> None:
        """An operator is about to write ``tensor``: refuse, back it up, or let it be.
        (``force``: a write assumed, of that kind, in a module's forward.)"""
        key = _key(tensor)
        if key in self.fresh:
            return
        if self.stepping:
            return  # (the optimizer step autobatch runs: counted once the operator ran)
        found = self.index.get(key)
        if found is None:
            found = self._classify(tensor, key)
        kind, name = found
        module = _forward_module() if kind is Kind.BUFFER and force is None else None
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            self._norms[id(module)] = module
        write = Write(
            kind=kind, name=name, op=op, where="", early=self.early,
            forward=force is not None or module is not None,
            backward=torch._C._current_autograd_node() is not None,
            stepped=self.stepped, first=tensor not in self.batch,
        )
        rule = RULES[kind]
        verdict = rule.decide(write)
        if verdict is Verdict.ALLOW:
            return
        if self.unwatched is not None and kind in _UNSEEN_KINDS and key not in self.unwatched:
            self.learned.append((kind, tensor))  # (copied on the fast path from now on)
            raise unseen_write(self.host.name, kind, name or self.name_of(tensor), tensor, op)
        if verdict is Verdict.REFUSE and _from_distributed():
            return  # torch.distributed's own (FSDP2 gathering into its unsharded parameters)
        if verdict is Verdict.BACKUP:
            self._back_up(tensor)
            if kind is not Kind.GRADIENT:  # (what the fast path copies, or counts)
                self.learned.append((kind, tensor))
            return
        shown = name or self.name_of(tensor)
        raise refusal(
            self.host.name,
            f"changed {kind.value} {shown} ({_describe(tensor)}) in place ({op})",
            user_frame(), rule.why, rule.fix,
        )

    def adopt(self, params: Iterable[torch.Tensor]) -> None:
        """Leaves found receiving gradients in a backward (parameters outside the known
        modules, a learned temperature): their data and gradients are indexed as parameters'
        and gradients' from now on, their gradients put back on a restart."""
        if not self._is_open:
            return
        for p in params:
            label = self.name_of(p)
            for t in _tensors((p,)):
                self.index.setdefault(_key(t), (Kind.PARAMETER, label))
            grad = p.grad
            if grad is not None and all(q is not p for q, _ in self.carried):
                for t in _tensors((grad,)):
                    self.index.setdefault(_key(t), (Kind.GRADIENT, f"{label}.grad"))
            if all(q is not p for q, _ in self.carried):
                ref = None if grad is None else weakref.ref(grad)
                self.carried.append((p, ref))
                self.batch.keep(("gradient", id(p)), (p, ref), _put_gradient)

    def _back_up(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` before its first write in this attempt (and in this batch)."""
        if self._is_open:
            copy = self.batch.take(tensor) if tensor not in self.batch else None
            self.piece.take(tensor, copy)
        else:  # a whole attempt (no batch opened): one set of copies
            self.piece.take(tensor)

    def _classify(self, tensor: torch.Tensor, key: int) -> tuple[Kind, str]:
        """A tensor not in the index: a buffer of a module whose forward runs, torch.distributed's
        own, or another tensor."""
        node = torch._C._current_autograd_node()
        leaf = getattr(node, "variable", None)  # AccumulateGrad adding into a leaf's .grad
        if isinstance(leaf, torch.Tensor) and leaf.grad is not None and _key(leaf.grad) == key:
            return (Kind.GRADIENT, f"the gradient of a {_describe(leaf)} leaf")
        module = _forward_module()
        if module is not None:
            for name, buffer in module.named_buffers():
                if buffer is not None and _key(buffer) == key:
                    found = (Kind.BUFFER, f"{type(module).__name__}.{name}")
                    self.index[key] = found
                    return found
        if _from_distributed():
            return (Kind.FRAMEWORK, "")
        return (Kind.OTHER, "")

    def name_of(self, tensor: torch.Tensor) -> str:
        """Where a tensor can be found, for messages: a module path, an attribute, a key."""
        key = _key(tensor)
        indexed = self.index.get(key)
        if indexed is not None and indexed[1]:
            return indexed[1]
        for prefix, module in self.host.named_modules_known():
            for name, t in (*module.named_parameters(), *module.named_buffers()):
                if t is not None and _key(t) == key:
                    return f"{prefix}.{name}"
        found = _search(getattr(self.host, "fn", None), key)
        return found or "(one the step holds)"

    # After an attempt -------------------------------------------------------------------------

    def check_piece(self, params: Iterable[torch.Tensor], unfolded: set[int]) -> None:
        """After an early piece that succeeded: refuse what it changed outside the operators
        (run before any optimizer stepped)."""
        edge = Edge(
            self.host.name, list(params), unfolded,
            {id(p): ref() for p, ref in self.carried if ref is not None},
            self.host.optimizers, self.hyper, self.name_of,
        )
        for check in CHECKS:
            check(edge)
        self.piece = Backups()

    def _keep_changing(self, store: Backups) -> None:
        """Save in ``store`` what any attempt may change without a write the mode sees: the
        metrics' states (a list state grows by appending) and the RNG streams."""
        for metric in self.metrics:
            store.keep(("metric", id(metric)), _metric_state(metric), _put_metric)
        store.keep("rng", save_rng_states(host=True), restore_rng_states)

    def drew_host_rng(self) -> bool:
        """Whether the batch drew from Python's or NumPy's stream (so far): from then on
        the fast path saves them too."""
        kept = self.batch.entries.get("rng")
        return isinstance(kept, _Kept) and host_rng_moved(kept.value)

    def undo_piece(self) -> None:
        """Put back what the failed attempt changed (the earlier pieces' work stays)."""
        self.piece.put_back()

    def undo_batch(self) -> None:
        """Put back everything since the batch began (a restart, a refusal, an error)."""
        self.batch.put_back()  # (first: a gradient the batch began with may live on in the
        self.piece = Backups()  # piece's backups alone)

    def seen(self) -> Seen:
        """What the failed attempt did that :meth:`undo_piece` does not undo, for the judge
        (:func:`._rules.judge`): the optimizer steps that began, and whether one of them
        wrote a parameter (seen by the mode, or by the version counters where compiled code
        wrote it); every other write was backed up or refused before it happened."""
        return Seen(
            stepped=list(self.began), fresh=set(self.firsts),
            changed="its parameters" if self.step_changed_parameters() else "",
        )

    def first_attempt_written(self) -> list[tuple[Kind, torch.Tensor]]:
        """What watched whole attempts wrote that the fast path should copy (then forget)."""
        learned, self.learned = self.learned, []
        return learned


