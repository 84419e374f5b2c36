"""One attempt of a step: what it changed (optimizer steps, parameters, buffers), and
undoing what can be undone."""

from __future__ import annotations

import contextvars
import operator
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from autobatch._errors import AutobatchError
from autobatch._oom import MAX_CHAIN_DEPTH
from autobatch._recovery._accumulate import _Accumulation

_VERSION = operator.attrgetter("_version")  # a tensor's in-place modification counter


class _Host(Protocol):
    """What an attempt needs of the engine that runs it."""

    name: str
    optimizers: tuple[torch.optim.Optimizer, ...]
    known: _Known
    keeps_gradients: bool


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
_step_hook: RemovableHandle | None = None


def _see_optimizer_steps() -> None:
    """Install, once per process, the hook through which attempts see every optimizer step (a
    context-variable read per ``optimizer.step()`` when no attempt runs)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_optimizer_stepping)


def _optimizer_stepping(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    attempt = _ATTEMPT.get()
    while attempt is not None:
        attempt.optimizer_stepping(optimizer)
        attempt = attempt.outer


class _Attempt:
    """One run of a step function (a whole batch or one piece), watched for what it changes.

    It records every ``optimizer.step()`` that begins (a global pre-hook), the version counters
    (in-place modification counts) of the parameters the step may touch, and the module buffers
    as they were: those known to change (BatchNorm statistics) are copied before it starts, and,
    while ``learn`` is on, those of every module the first time it runs (a global forward
    pre-hook, which also makes the modules known). :meth:`rollback` puts the buffers back after
    a failure. With ``split`` (a piece of a batch under ``"accumulate"``) an optimizer the
    engine was not given is refused before it steps.
    """

    __slots__ = (
        "_hook", "_param_ids", "_saved_owners", "_seen_ids", "_token", "engine", "fresh", "grads",
        "learn", "ours_stepped", "outer", "params", "saved", "seen", "session", "shadows",
        "split", "stepped", "versions",
    )

    def __init__(
        self,
        engine: _Host,
        *,
        split: bool = False,
        learn: bool = False,
        session: _Accumulation | None = None,
    ) -> None:
        known = engine.known
        self.engine = engine
        self.split = split
        self.learn = learn
        self.session = session
        self.stepped: list[torch.optim.Optimizer] = []
        self.ours_stepped = False
        self.params = known.params
        self.versions = list(map(_VERSION, known.params))
        self.fresh = [not o.state for o in engine.optimizers]
        self.shadows = known.save_buffers() if known.mutable else None
        self.grads = (  # where the caller accumulates over calls: the gradients as they were
            [(p, p.grad, -1 if p.grad is None else p.grad._version) for p in known.params]
            if engine.keeps_gradients else None
        )
        self.saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]] = []
        self.seen: list[nn.Module] = []
        self.outer: _Attempt | None = None
        self._token: contextvars.Token[_Attempt | None] | None = None
        self._hook: RemovableHandle | None = None

    def __enter__(self) -> _Attempt:
        self.outer = _ATTEMPT.get()
        self._token = _ATTEMPT.set(self)
        if self.learn:
            known = self.engine.known
            self._seen_ids: set[int] = set()
            self._saved_owners: set[int] = set()
            self._param_ids = set(known.param_ids)
            self.params = list(self.params)
            for module in known.modules:
                self._module_runs(module, ())
            if not known.compiled:  # a global hook would make dynamo compile once more
                self._hook = register_module_forward_pre_hook(self._module_runs)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _ATTEMPT.reset(self._token)
            self._token = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> None:
        ours = any(optimizer is o for o in self.engine.optimizers)
        if not ours and self.split:
            raise AutobatchError(
                f"{self.engine.name} calls {type(optimizer).__name__}.step(), an optimizer "
                "autobatch was not given, while its batch runs in micro-batches: that optimizer "
                "would step once per micro-batch instead of once per batch. Pass every optimizer "
                "the step calls, retry_on_oom(optimizer=[opt_a, opt_b]); where one optimizer's "
                "step feeds the next part of the step (a GAN's discriminator, then its "
                "generator), decorate each part as its own function; or use policy='shrink'"
            )
        self.stepped.append(optimizer)
        self.ours_stepped = self.ours_stepped or ours

    def _module_runs(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or id(module) in self._seen_ids:
            return  # (inside a compiled module the hook is traced away: its caller was seen)
        self._seen_ids.add(id(module))
        self.seen.append(module)
        known = self.engine.known
        for owner in module.modules():  # the whole subtree: compiled code runs no hook inside
            if id(owner) in self._saved_owners:
                continue
            self._saved_owners.add(id(owner))
            for name, buffer in owner._buffers.items():
                if (
                    buffer is None
                    or id(buffer) in known.saved_ids
                    or name in owner._non_persistent_buffers_set  # masks, caches: not state
                ):
                    continue
                with torch.no_grad():
                    copy = buffer.detach().clone()
                self.saved.append((owner, name, buffer, copy, buffer._version))
        for p in module.parameters():
            if id(p) not in self._param_ids:  # watched from now on, like the known ones
                self._param_ids.add(id(p))
                self.params.append(p)
                self.versions.append(p._version)
        if self.session is not None:
            self.session.track(module.parameters())

    def changed(self) -> list[torch.Tensor]:
        """The parameters changed in place since the attempt began."""
        return [
            p for p, version in zip(self.params, self.versions, strict=True)
            if p._version != version
        ]

    def gradients_untouched(self) -> bool:
        """Whether the gradients from before the attempt are as they were (the failed attempt
        added nothing to them); those it created are dropped."""
        if self.grads is None:
            return True
        untouched = True
        for p, grad, version in self.grads:
            if grad is None:
                p.grad = None  # made by the failed attempt: partial
            elif p.grad is not grad or grad._version != version:
                untouched = False
        return untouched

    def stepped_other(self) -> torch.optim.Optimizer | None:
        """An optimizer the engine was not given that began a step in this attempt."""
        for optimizer in self.stepped:
            if all(optimizer is not o for o in self.engine.optimizers):
                return optimizer
        return None

    def rollback(self) -> None:
        """Put every saved buffer back as it was when the attempt began (after a failure)."""
        with torch.no_grad():
            _Known.restore_buffers(self.shadows)
            for module, name, original, copy, _ in reversed(self.saved):
                if module._buffers.get(name) is not original:
                    module._buffers[name] = original
                original.copy_(copy)  # (kernels such as batch_norm's update without a version bump)

    def check(
        self,
        failure: _Failure,
        optimized: set[int],
        describe: Callable[[list[torch.Tensor]], str],
    ) -> None:
        """Raise unless retrying is safe; after a failed first step, drop the state it made.

        Safe: nothing was changed in place that autobatch cannot put back (no optimizer
        stepped, no parameter changed), or the OOM came inside an optimizer's first step while
        it created its state and before any parameter changed.
        """
        kind = failure.kind
        inside = failure.inside
        if inside is not None and all(inside is not o for o in self.engine.optimizers):
            raise AutobatchError(
                f"{self.engine.name} ran out of memory ({kind}) inside {type(inside).__name__}.step(), "
                "an optimizer autobatch was not given, so it cannot tell whether the update was "
                "partly applied; pass every optimizer the step calls: "
                "retry_on_oom(optimizer=...)"
            ) from failure.exc
        other = self.stepped_other()
        if other is not None:
            raise AutobatchError(
                f"{self.engine.name} ran out of memory ({kind}) after {type(other).__name__}.step(), an "
                "optimizer autobatch was not given, had run in this step: retrying would step "
                "it twice. Pass every optimizer the step calls, "
                "retry_on_oom(optimizer=[opt_a, opt_b]); where one optimizer's step feeds the "
                "next part of the step (a GAN), decorate each part as its own function"
            ) from failure.exc
        changed = self.changed()
        foreign = [p for p in changed if id(p) not in optimized]
        if foreign:
            raise AutobatchError(
                f"{self.engine.name} ran out of memory ({kind}) after it had changed "
                f"{describe(foreign)} in place, outside the optimizer autobatch was given "
                "(an EMA update, say): retrying would change it again. Move that update out of "
                "the decorated step (after it returns), or pass that parameter's optimizer too"
            ) from failure.exc
        # Fused optimizers update without counting a modification: which steps began is known
        # from the step hook, not from the version counters alone.
        stepped = [o for o in self.stepped if any(o is mine for mine in self.engine.optimizers)]
        finished = [o for o in stepped if o is not inside]
        if inside is None or finished:
            if changed or finished:
                raise AutobatchError(
                    f"{self.engine.name} ran out of memory ({kind}) after "
                    + (f"{type(finished[0]).__name__}.step()" if finished else "optimizer.step()")
                    + " had updated the parameters; retrying would apply the update twice, so "
                    "it is not retried. Restore from a checkpoint, and leave more memory free "
                    "after the step, or move that work out of the step"
                ) from failure.exc
            return
        index = next(i for i, o in enumerate(self.engine.optimizers) if o is inside)
        name = type(inside).__name__
        fused = any(g.get("fused") for g in inside.param_groups)
        unknown = fused and len(inside.param_groups) > 1  # an earlier group may be updated
        if self.fresh[index] and not changed and not unknown:
            inside.state.clear()  # every entry was made by the failed first step, some half-made
            return
        hint = "; foreach=False needs fewer temporaries" if _uses_foreach(inside) else ""
        if self.fresh[index]:
            what = (
                f"which had already changed {len(changed)} of its parameters in place "
                f"({describe(changed)}; weight decay is applied before the moments, say)"
                if changed else "whose fused kernels may already have updated an earlier "
                "parameter group (fused kernels leave no trace in the version counters)"
            )
            raise AutobatchError(
                f"{self.engine.name} ran out of memory ({kind}) inside the first step of {name} (while "
                f"it created its state), {what}: the update is partly applied and cannot be "
                "undone, so it is not retried. Restore from a checkpoint. To avoid it, leave "
                "memory for the optimizer's state, which its first step creates: a smaller first "
                "batch, or autobatch.find_max_batch with this optimizer, which counts that "
                "state" + hint
            ) from failure.exc
        raise AutobatchError(
            f"{self.engine.name} ran out of memory ({kind}) inside {name}.step(), which updates its "
            "state and the parameters in place: the update may be partly applied, so it is "
            "not retried (autobatch retries an OOM inside a step only on the first step, while "
            "the state is being created and before any parameter changed). Restore from a "
            "checkpoint, and leave more memory free for the optimizer's step" + hint
        ) from failure.exc

    def learned(self) -> None:
        """Tell the engine which modules ran and which of their buffers changed."""
        if not self.learn:
            return
        with torch.no_grad():
            mutable = [
                (module, name) for module, name, original, copy, version in self.saved
                if module._buffers.get(name) is not original or original._version != version
                or not torch.equal(original, copy)
            ]
        self.engine.known.learn(self.seen, mutable)


def _uses_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer runs its multi-tensor (foreach) kernels, which need temporaries."""
    for group in optimizer.param_groups:
        foreach = group.get("foreach")
        if foreach or (foreach is None and not group.get("fused") and any(
            cast(torch.Tensor, p).device.type != "cpu" for p in group["params"]
        )):
            return True
    return False


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is ``torch.compile``d."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


_Shadows = tuple[list[tuple[nn.Module, str]], list[torch.Tensor], list[torch.Tensor]]


class _Known:
    """What a step is known to touch: the optimizers' parameters, the modules it runs
    (``model=``, modules its code names, modules seen running) with their parameters, and the
    buffers that change when they run, copied before every attempt (one fused copy) so that a
    failed attempt can be undone."""

    def __init__(
        self, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
    ) -> None:
        self.modules: list[nn.Module] = []
        self.module_ids: set[int] = set()
        self.params: list[torch.Tensor] = []
        self.param_ids: set[int] = set()
        self.mutable: list[tuple[nn.Module, str]] = []
        self.buffers: list[torch.Tensor] = []
        self.shadows: list[torch.Tensor] = []
        self.saved_ids: set[int] = set()
        self.compiled = False
        for optimizer in optimizers:
            self._add_params(p for g in optimizer.param_groups for p in g["params"])
        self.learn(modules, [])

    def _add_params(self, params: Iterable[torch.Tensor]) -> None:
        added = [p for p in params if id(p) not in self.param_ids]
        if added:
            self.params = self.params + added  # a new list: attempts keep the one they began with
            self.param_ids.update(id(p) for p in added)

    def learn(self, modules: Iterable[nn.Module], mutable: list[tuple[nn.Module, str]]) -> None:
        for module in modules:
            if id(module) not in self.module_ids:
                self.module_ids.add(id(module))
                self.modules.append(module)
                self._add_params(module.parameters())
                self.compiled = self.compiled or _is_compiled(module)
        fresh = [entry for entry in mutable if all(
            entry[0] is not m or entry[1] != n for m, n in self.mutable)]
        if fresh:
            self.mutable = self.mutable + fresh
            self._rebuild()

    def _rebuild(self) -> None:
        self.mutable = [(m, n) for m, n in self.mutable if m._buffers.get(n) is not None]
        self.buffers = [cast(torch.Tensor, m._buffers[n]) for m, n in self.mutable]
        with torch.no_grad():
            self.shadows = [torch.empty_like(b) for b in self.buffers]
        self.saved_ids = {id(b) for b in self.buffers}

    def save_buffers(self) -> _Shadows | None:
        """Copy the buffers known to change into their shadows; ``None`` when there are none."""
        if not self.mutable:
            return None
        if any(m._buffers.get(n) is not b
               for (m, n), b in zip(self.mutable, self.buffers, strict=True)):
            self._rebuild()  # a module replaced a buffer: copy what it holds now
        with torch.no_grad():
            torch._foreach_copy_(self.shadows, self.buffers)
        return self.mutable, self.buffers, self.shadows

    @staticmethod
    def restore_buffers(saved: _Shadows | None) -> None:
        if saved is None:
            return
        mutable, buffers, shadows = saved
        for (module, name), original in zip(mutable, buffers, strict=True):
            if module._buffers.get(name) is not original:
                module._buffers[name] = original
        torch._foreach_copy_(buffers, shadows)
