"""The rules of the write ledger (:mod:`._ledger`) and their wording: what a watched step may
change, and how each change is judged; the one judge of a failed attempt, whichever path ran
it; and the retry rule for an OOM inside an optimizer's first step, which the ranks'
agreement shares. What they judge is read off torch by :mod:`._inspect`.

A write to a tensor that existed before an attempt is judged by the rule of its kind
(:data:`RULES`):

- allowed: the optimizer steps autobatch defers to the last micro-batch, a module's buffers
  written in its forward (BatchNorm statistics: once per micro-batch, as in gradient
  accumulation), autograd adding into a gradient, metric states and declared tensors;
- backed up before the first write of each attempt, so that a failed attempt is put back bit
  for bit (and, when the batch starts over, everything since the batch began);
- refused before it happens, with :class:`Refusal`, where it would run once per micro-batch
  instead of once per batch (an early micro-batch writing a parameter, an EMA, a buffer
  outside a forward, a gradient carried from an earlier call, any other tensor).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from autobatch._errors import AutobatchError
from autobatch._recovery._inspect import (
    user_frame,
)

# What was written -----------------------------------------------------------------------------


class Kind(enum.Enum):
    """What a tensor that existed before an attempt is to the step."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    BUFFER = "buffer"
    OPTIMIZER = "optimizer state"
    METRIC = "metric state"
    ADDITIVE = "tensor declared additive"
    BATCH = "batch"
    FRAMEWORK = "torch.distributed's own tensor"
    OTHER = "tensor"


@dataclass(frozen=True)
class Write:
    """One write an attempt made, as the rules see it."""

    kind: Kind
    name: str
    op: str
    where: str
    early: bool  # in a micro-batch before the last
    forward: bool  # inside a module's forward
    backward: bool  # inside autograd's backward
    stepped: bool  # after an optimizer of the step began its (real) step
    first: bool = False  # the batch had not written this tensor before


class Verdict(enum.Enum):
    ALLOW = "allow"
    BACKUP = "backup"  # copied first, put back after a failure
    REFUSE = "refuse"


@dataclass(frozen=True)
class Rule:
    """How writes to one kind of tensor are judged; ``why`` and ``fix`` go into the refusal."""

    kind: Kind
    decide: Callable[[Write], Verdict]
    why: str = ""
    fix: str = ""


def _outside_step(w: Write) -> Verdict:
    """Parameters and optimizer state: only the optimizer step changes them exactly once (a
    whole attempt's write before it, Embedding(max_norm=)'s renormalisation in forward, is
    copied first, so that a failure after it is undone)."""
    if w.early:
        return Verdict.REFUSE
    return Verdict.ALLOW if w.stepped else Verdict.BACKUP


#: Operators that zero a tensor (``zero_grad(set_to_none=False)``, ``grad.zero_()``).
ZEROING = frozenset({"aten::zero_", "aten::_foreach_zero_"})


def _gradient(w: Write) -> Verdict:
    if w.backward:
        return Verdict.BACKUP  # autograd adding into it
    if w.early and w.first and w.op in ZEROING:
        # a gradient carried into the batch, zeroed before any piece added to it (zero_grad
        # with set_to_none=False at the start of the step): the same as dropping it
        return Verdict.BACKUP
    if w.early:
        return Verdict.REFUSE
    # (a whole attempt's write before its optimizer step, zero_grad first: a refusal after
    # it puts the gradient back)
    return Verdict.ALLOW if w.stepped else Verdict.BACKUP


def _buffer(w: Write) -> Verdict:
    if w.forward or w.backward:
        return Verdict.BACKUP
    if w.early:
        return Verdict.REFUSE
    return Verdict.ALLOW if w.stepped else Verdict.BACKUP


def _other(w: Write) -> Verdict:
    if w.early:
        return Verdict.REFUSE
    return Verdict.ALLOW if w.stepped else Verdict.BACKUP


_ONCE = (
    "it would change once per micro-batch instead of once per batch (an EMA update, a manual "
    "edit, a second model's step)"
)
_MOVE = (
    "move that update out of the decorated step (after it returns), pass the optimizer that "
    "does it (optimizer=[...]), or use policy='shrink'"
)

#: One rule per kind of tensor (see the module documentation).
RULES: dict[Kind, Rule] = {rule.kind: rule for rule in (
    Rule(Kind.PARAMETER, _outside_step, _ONCE, _MOVE),
    Rule(Kind.OPTIMIZER, _outside_step, _ONCE, _MOVE),
    Rule(
        Kind.GRADIENT, _gradient,
        "a gradient carried from an earlier call would be changed once per micro-batch (the "
        "sums so far a micro-batch shows in .grad may be changed: the change is made once, on "
        "the whole batch's gradient, in the last micro-batch)",
        "change gradients between backward() and optimizer.step(), or after the decorated step "
        "returns",
    ),
    Rule(
        Kind.BUFFER, _buffer,
        "a buffer written outside its module's forward would change once per micro-batch",
        "write it in the module's forward, or after the decorated step returns",
    ),
    Rule(Kind.METRIC, lambda w: Verdict.BACKUP),
    Rule(Kind.ADDITIVE, lambda w: Verdict.BACKUP),
    Rule(Kind.BATCH, lambda w: Verdict.BACKUP),
    Rule(Kind.FRAMEWORK, lambda w: Verdict.ALLOW),
    Rule(
        Kind.OTHER, _other, _ONCE,
        "move that update out of the decorated step (after it returns); for a running sum that "
        "adds per row, declare it: retry_on_oom(additive=[tensor])",
    ),
)}


#: What a split step refuses, one line each, as the README lists it (``tests/test_ledger.py``
#: checks that the README and this table agree, and that each line has a test).
REFUSED: tuple[str, ...] = (
    "a parameter or optimizer state changed in place outside the optimizer step, in a "
    "micro-batch before the last (an EMA or teacher update, weight clipping, the "
    "renormalisation of `Embedding(max_norm=...)`, a manual edit)",
    "any other tensor that existed before the step changed in place in a micro-batch before "
    "the last (a running sum, a dict of shadow weights, a buffer written outside its module's "
    "forward), unless declared with `additive=`",
    "a gradient carried from an earlier call changed in place, other than zeroed, in a "
    "micro-batch before the last",
    "a `.grad` assigned by the step (`torch.autograd.grad`, then `p.grad = g`: gradient "
    "surgery)",
    "an optimizer hyperparameter changed in the step: an LR scheduler not given as "
    "`scheduler=`, or an `lr` changed by hand; a scheduler stepped with arguments "
    "(`ReduceLROnPlateau`); a parameter group added (`add_param_group`) in a micro-batch "
    "before the last",
    "a buffer, parameter or submodule assigned into the step's modules outside every forward, "
    "in a micro-batch before the last (`model.loss_ema = 0.9 * model.loss_ema + ...`, a new "
    "head): each micro-batch would assign it anew",
    "an optimizer the decorator was not given stepping in a micro-batch; a step that "
    "interleaves optimizers (a GAN's discriminator, then its generator: decorate each part)",
    "a gradient hook on a parameter (`register_hook`), which would see each micro-batch's "
    "part of the gradient",
    "a backward that does not go through `torch.autograd.backward` (so it cannot be weighted), "
    "and `optimizer.step(closure)` (LBFGS)",
    "an OOM after an optimizer step began changing parameters (except inside an optimizer's "
    "first step, before any parameter changed, which is retried): the update stays applied, "
    "and the step is not retried",
    "a micro-batch that takes another path than the batch's first (another number of "
    "`backward()` calls, an optimizer, scaler or scheduler step the first did not take): a "
    "decision from Python state the step keeps in a list or an object other than its own "
    "(`calls.append(1); if len(calls) % 2 == 0: opt.step()`; a number in its closure, in a "
    "dict there, in a global it assigns, on its `self` or on a module or an object of one's "
    "own it holds is put back before each micro-batch, and decides as the batch does), a "
    "branch on a micro-batch's values",
    "a bare `@retry_on_oom` (no `optimizer=`, no `policy=`) on a step known to call "
    "`optimizer.step()`: each micro-batch would take its own step (where the first sign of it "
    "is a micro-batch's step, a warning names the optimizer instead)",
    "a loss that mixes the batch's rows, found by following the rows through every operator "
    "of a micro-batch's forward: a product or distance that pairs rows (InfoNCE and CLIP's "
    "`za @ zb.T`, `torch.cdist`, batch-hard triplet mining, shuffled or rolled negatives, an "
    "output of `(N,)` against a target of `(N, 1)` that broadcasts to N × N), a max, min, "
    "sort, top-k, softmax, cumulative sum or normalisation over the rows, a sum over "
    "the rows used non-linearly or with the rows themselves (`x - x.mean(0)`), part of the "
    "rows (a slice, the first row as anchor, a row picked by an argmax or a sort: "
    "`l[l.argmax()]`, `l.sort().values[0]`), rows weighted by their place (by their rank "
    "after a sort, `l * torch.linspace(0, 1, n)`), and a mean whose count depends on the "
    "batch's content (`l.sum() / mask.sum()`, `l[mask].mean()`, `ignore_index` or class "
    "weights that leave rows with different counts) without `items=`; under `items=`, two "
    "means over different masks, or a mean over the rows beside the items' mean (BERT "
    "pretraining's next-sentence term) where a micro-batch's share of the items is not its "
    "share of the rows; the refusal names the operator and the line that "
    "mixed the rows, and for a loss over the whole batch's embeddings points to "
    "`embed_in_pieces`",
    "a loss of another kind than `reduction=` weighs, found the same way: a sum over the "
    "rows (`reduction=\"sum\"` in the loss, `l.sum() / 16`) where micro-batches are weighed "
    "by their share of the rows (the default, `reduction=\"mean\"`), a mean where "
    "`reduction=\"sum\"` adds them whole, and a term without rows that learns (a penalty on "
    "the weights) added to a sum under `reduction=\"sum\"`, which would count once per "
    "micro-batch",
)


class Refusal(AutobatchError):
    """A split step did something that cannot be replayed exactly; nothing of the batch was
    kept (the state is as it was before the call)."""


def refusal(step: str, what: str, where: str, why: str, fix: str) -> Refusal:
    """The one place refusals are worded: what happened, where, why, and the fix."""
    return Refusal(
        f"{step} {what}, at {where}, while its batch ran in micro-batches after an "
        f"out-of-memory error: {why}. The batch was not split and nothing of it was kept. To "
        f"fix: {fix}"
    )


def assigned_early(step: str, owner: str, name: str) -> Refusal:
    """A buffer, parameter or submodule assigned outside every forward in a micro-batch before
    the last (a functional EMA, a new head): each micro-batch would assign it anew, from what
    the one before left."""
    return refusal(
        step, f"assigned {owner}.{name} (a buffer, parameter or submodule) outside its module's "
        "forward (a forward called directly, model.forward(x), is outside it: call the "
        "module, model(x))", user_frame(), "it would be assigned once per micro-batch instead of once per "
        "batch, each time from what the micro-batch before left (a functional EMA, a new head)",
        "assign it after the decorated step returns, or in its module's forward, or update the "
        "buffer in place (autobatch then keeps or refuses it by the rules for writes)",
    )


def unseen_write(step: str, kind: Kind, name: str, tensor: torch.Tensor, op: str) -> Refusal:
    """A write, in the retry of a batch whose whole attempt failed unwatched, to state that
    attempt had no copy of: it may have changed it already."""
    return Refusal(
        f"{step} changed {kind.value} {name} ({_describe(tensor)}) in place ({op}), at "
        f"{user_frame()}, which no call autobatch watched had changed. The whole batch ran "
        "first, unwatched, and ran out of memory: it may have changed it already, and "
        "autobatch holds no copy from before it, so running the batch again could change it "
        f"twice. The batch is not retried; the rest of its state is as before the call, but "
        f"{name} may stay changed. To fix: create the tensor before the first call of the "
        "decorated step (a buffer registered on a module the step runs is learned when it is "
        "registered), declare a running sum with additive=[tensor], or make the change after "
        "the decorated step returns. autobatch copies it from now on"
    )


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"


# One judge for a failed attempt ----------------------------------------------------------------


@dataclass
class Seen:
    """What a failed attempt did that its backups do not undo, as far as its path saw: the
    fast path by the optimizer steps' pre-hook and version counters, a watched attempt by the
    ledger (which backed up every other write it judged). :func:`judge` decides for both."""

    stepped: list[torch.optim.Optimizer] = field(default_factory=list)  # steps that began
    fresh: set[int] = field(default_factory=set)  # ids of those whose step was their first
    changed: str = ""  # parameters a step changed before the OOM, described
    foreign: str = ""  # parameters changed in place that no optimizer of the step updates
    before: str = ""  # parameters changed in place before any step, with no copy to put back
    batch: bool = False  # the batch was changed in place, with no copy to put back
    carried: bool = False  # gradients carried into the call were added to outside backward


def judge(
    name: str, kind: str, inside: torch.optim.Optimizer | None, seen: Seen,
    ours: tuple[torch.optim.Optimizer, ...],
) -> AutobatchError | None:
    """Why a failed attempt may not run again, or ``None`` where it may: nothing it did is
    beyond undoing, or the OOM came inside an optimizer's first step while it created its
    state and before any parameter changed (that state is dropped here). The same for every
    path."""
    if seen.batch:
        return AutobatchError(
            f"{name} ran out of memory ({kind}) after it had changed its batch in place: "
            "running the batch again would apply that change twice, so it is not retried. "
            "Change a copy of the batch (x = x / 255 instead of x /= 255), or do it before "
            "the decorated step"
        )
    if seen.carried:
        return AutobatchError(
            f"{name} ran out of memory ({kind}) after it had added to gradients carried from "
            "earlier calls where they were not kept apart (outside torch.autograd.backward, "
            "in a second backward of the same call, or in the first call that kept them "
            "after calls that dropped them first with zero_grad()): they hold part of this "
            "batch's gradient, which cannot be taken apart again, so the batch is not "
            "retried and they stay changed. Later calls keep them apart; zero them and skip "
            "this batch, or restore from a checkpoint"
        )
    if inside is not None and all(inside is not o for o in ours):
        return AutobatchError(
            f"{name} ran out of memory ({kind}) inside {type(inside).__name__}.step(), an "
            "optimizer autobatch was not given, so it cannot tell whether the update was "
            "partly applied; pass every optimizer the step calls: retry_on_oom(optimizer=...)"
        )
    other = next((o for o in seen.stepped if all(o is not mine for mine in ours)), None)
    if other is not None:
        return AutobatchError(
            f"{name} ran out of memory ({kind}) after {type(other).__name__}.step(), an "
            "optimizer autobatch was not given, had run in this step: retrying would step "
            "it twice. Pass every optimizer the step calls, "
            "retry_on_oom(optimizer=[opt_a, opt_b]); where one optimizer's step feeds the "
            "next part of the step (a GAN), decorate each part as its own function"
        )
    if seen.foreign:
        return AutobatchError(
            f"{name} ran out of memory ({kind}) after it had changed {seen.foreign} in place, "
            "outside the optimizer autobatch was given (an EMA update, say): retrying would "
            "change it again. Move that update out of the decorated step (after it returns), "
            "or pass that parameter's optimizer too"
        )
    if seen.before:
        return AutobatchError(
            f"{name} ran out of memory ({kind}) after it had changed {seen.before} in place "
            "outside an optimizer step (Embedding(max_norm=...) renormalises its weight in "
            "forward, for one): running the batch again would change it again, so it is not "
            "retried, and the change stays. Restore from a checkpoint; to avoid it, make that "
            "change before the decorated step (torch.embedding_renorm_ under no_grad, then an "
            "Embedding without max_norm inside)"
        )
    # Fused optimizers update without counting a modification: which steps began is known
    # from the step hook, not from the version counters alone.
    finished = [o for o in seen.stepped if o is not inside]
    if inside is None or finished:
        if seen.changed or finished:
            return AutobatchError(
                f"{name} ran out of memory ({kind}) after "
                + (f"{type(finished[0]).__name__}.step()" if finished else "optimizer.step()")
                + " had updated the parameters; retrying would apply the update twice, so it "
                "is not retried. Restore from a checkpoint, and leave more memory free after "
                "the step, or move that work out of the step"
            )
        return None
    fresh = id(inside) in seen.fresh
    if first_step_retryable(inside, fresh=fresh, params_changed=bool(seen.changed)):
        return None
    # (an optimizer that keeps no state, plain SGD, has none at any step: not a first step)
    return first_step_error(name, kind, inside, fresh=fresh and bool(inside.state),
                            changed=seen.changed)


# The retry rule for an OOM inside a first step ------------------------------------------------


def first_step_retryable(
    optimizer: torch.optim.Optimizer, *, fresh: bool, params_changed: bool
) -> bool:
    """Whether an OOM inside ``optimizer.step()`` may be retried: only in its first step
    (``fresh``: it had no state), while it created its state, before any parameter changed.
    A fused optimizer with several groups may have updated an earlier one without a trace in
    the version counters, so it is not. The half-made state is dropped here when it may."""
    fused = any(g.get("fused") for g in optimizer.param_groups)
    unknown = fused and len(optimizer.param_groups) > 1
    if fresh and not params_changed and not unknown:
        optimizer.state.clear()  # every entry was made by the failed first step
        return True
    return False


def first_step_error(
    name: str, kind: str, optimizer: torch.optim.Optimizer, *, fresh: bool, changed: str
) -> AutobatchError:
    """Why an OOM inside ``optimizer.step()`` was not retried."""
    label = type(optimizer).__name__
    hint = "; foreach=False needs fewer temporaries" if _uses_foreach(optimizer) else ""
    if fresh:
        what = (
            f"which had already changed {changed} in place (weight decay is applied before "
            "the moments, say)" if changed else "whose fused kernels may already have updated "
            "an earlier parameter group (fused kernels leave no trace in the version counters)"
        )
        return AutobatchError(
            f"{name} ran out of memory ({kind}) inside the first step of {label} (while it "
            f"created its state), {what}: the update is partly applied and cannot be undone, "
            "so it is not retried. Restore from a checkpoint. To avoid it, leave memory for the "
            "optimizer's state, which its first step creates: a smaller first batch, or "
            "autobatch.find_max_batch with this optimizer, which counts that state" + hint + "."
        )
    return AutobatchError(
        f"{name} ran out of memory ({kind}) inside {label}.step(), which updates its state "
        "and the parameters in place: the update may be partly applied, so it is not retried "
        "(autobatch retries an OOM inside a step only on the first step, while the state is "
        "being created and before any parameter changed). The parameters' .grad hold this "
        "batch's gradients, as its backward() left them. Restore from a checkpoint, and leave "
        "more memory free for the optimizer's step" + hint + "."
    )


def _uses_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer runs its multi-tensor (foreach) kernels, which need temporaries."""
    for group in optimizer.param_groups:
        foreach = group.get("foreach")
        if foreach or (foreach is None and not group.get("fused") and any(
            cast(torch.Tensor, p).device.type != "cpu" for p in group["params"]
        )):
            return True
    return False


# Changes seen at the edges of an attempt -------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    """What the checks at the end of an early piece look at."""

    step: str
    params: list[torch.Tensor]
    unfolded: set[int]
    carried: dict[int, torch.Tensor | None]
    optimizers: tuple[torch.optim.Optimizer, ...]
    hyper: list[list[dict[str, Any]]]
    name_of: Callable[[torch.Tensor], str]



def _gradient_assigned(edge: Edge) -> None:
    """After an early piece every gradient was folded into autobatch's sums: one in ``.grad``
    now (other than one carried from before the batch, which no backward reached) was put
    there by the step itself (``p.grad = ...`` after ``torch.autograd.grad``)."""
    for p in edge.params:
        grad = p.grad
        if grad is not None and id(p) not in edge.unfolded and grad is not edge.carried.get(id(p)):
            raise refusal(
                edge.step,
                f"set the gradient of {edge.name_of(p)} ({_describe(p)}) itself",
                "the end of a micro-batch",
                "autobatch weights and adds the gradients that backward() accumulates; a "
                "gradient assigned to .grad (after torch.autograd.grad, or gradient surgery) "
                "cannot be weighted per micro-batch, so only the last micro-batch's would count",
                "compute gradients with loss.backward(), or use policy='shrink'",
            )


def _hyperparameters_changed(edge: Edge) -> None:
    """An optimizer hyperparameter that changed in an early piece (a scheduler not given), or
    a parameter group added (``add_param_group``, which the next micro-batch would repeat)."""
    for optimizer, groups in zip(edge.optimizers, edge.hyper, strict=False):
        if len(optimizer.param_groups) != len(groups):
            raise refusal(
                edge.step,
                f"added a parameter group to {type(optimizer).__name__} "
                f"({len(groups)} groups, now {len(optimizer.param_groups)})",
                "a micro-batch before the last",
                "every micro-batch would add it again (torch refuses a parameter in two "
                "groups), each from the optimizer the one before left",
                "add the group after the decorated step returns (or before it is called)",
            )
        for index, (group, saved) in enumerate(zip(optimizer.param_groups, groups, strict=False)):
            for key, value in saved.items():
                now = group.get(key)
                if now is value or _same(now, value):
                    continue
                raise refusal(
                    edge.step,
                    f"changed {type(optimizer).__name__}.param_groups[{index}][{key!r}] "
                    f"from {value!r} to {now!r}",
                    "a micro-batch before the last",
                    "an LR scheduler or a manual change would run once per micro-batch instead "
                    "of once per batch",
                    "pass the scheduler, retry_on_oom(optimizer=opt, scheduler=sched), so that "
                    "it steps once per batch, or change hyperparameters outside the step",
                )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # pragma: no cover - an exotic value
        return False


#: What the ledger looks at after an early piece (:meth:`._ledger.Ledger.check_piece`), in order.
CHECKS: tuple[Callable[[Edge], None], ...] = (
    _gradient_assigned,
    _hyperparameters_changed,
)


