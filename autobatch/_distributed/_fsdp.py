"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as autobatch sees it: which modules are
sharded, and the few pieces of FSDP's state that micro-batches and failed attempts must reach.

FSDP2's public API is used where it has one (``reset_iter_state``, ``set_requires_gradient_sync``).
What it does not expose (the unsharded parameters, through which autograd computes the
gradients, a gradient accumulated in ``reduce_dtype`` across micro-batches, whether a group
reduces its gradients, the mixed-precision and offload policies) is read here only, each in one
function, and a torch whose FSDP2 has moved them raises :class:`~autobatch.AutobatchError`
naming what is missing rather than guessing.

Nothing here imports FSDP: modules are told apart by their classes' names, so a torch without
FSDP2 (or without torch.distributed) costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autobatch._errors import AutobatchError

_KINDS: dict[type, str | None] = {}


def kind(module: nn.Module) -> str | None:
    """``"fsdp2"`` for a module ``fully_shard`` made, ``"fsdp1"`` for a
    ``FullyShardedDataParallel`` wrapper, else ``None`` (cached per class)."""
    cls = type(module)
    found = _KINDS.get(cls, "")
    if found == "":
        names = {c.__name__ for c in cls.__mro__}
        found = _KINDS[cls] = (
            "fsdp2" if "FSDPModule" in names
            else "fsdp1" if "FullyShardedDataParallel" in names
            else None
        )
    return found


def sharded(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The FSDP2 modules among ``modules`` and their submodules, each once, in order."""
    found: dict[int, nn.Module] = {}
    for top in modules:
        for module in top.modules():
            if kind(module) == "fsdp2":
                found.setdefault(id(module), module)
    return list(found.values())


def roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules of ``model``'s tree (``model`` itself when it is one): those
    whose forward starts an iteration of FSDP's."""
    found: list[nn.Module] = []
    stack = [model]
    while stack:
        module = stack.pop()
        if kind(module) == "fsdp2":
            found.append(module)
        else:
            stack.extend(reversed(list(module.children())))
    return found


def _missing(what: str) -> AutobatchError:
    return AutobatchError(
        f"this torch's FSDP2 (torch {torch.__version__}) keeps {what} where autobatch does not "
        "find it, so autobatch cannot keep micro-batches and failed attempts exact under "
        "fully_shard; use the torch version autobatch is tested with, or "
        "retry_on_oom(sync_ranks=False) without FSDP"
    )


def _groups(module: nn.Module) -> list[Any]:
    """The parameter groups of ``module``'s own FSDP2 state (private: ``_fsdp_param_groups``)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    groups = getattr(get_state(), "_fsdp_param_groups", None) if get_state else None
    if groups is None:
        raise _missing("its parameter groups (FSDPModule._get_fsdp_state()._fsdp_param_groups)")
    return list(groups)


def _params(root: nn.Module, recurse: bool = True) -> Iterator[Any]:
    """Every ``FSDPParam`` of the FSDP2 modules in ``root``'s tree (``recurse=False``: of
    ``root``'s own groups)."""
    for module in sharded([root]) if recurse else [root]:
        for group in _groups(module):
            params = getattr(group, "fsdp_params", None)
            if params is None:
                raise _missing("the parameters of a group (FSDPParamGroup.fsdp_params)")
            yield from params


def unsharded_parameters(root: nn.Module, *, recurse: bool = True) -> list[torch.Tensor]:
    """The unsharded parameters of ``root``'s tree (``recurse=False``: of its own groups) that
    exist already (FSDP2 makes each at its group's first all-gather and keeps it): autograd
    computes gradients into them, and FSDP reduce-scatters those into the sharded parameters'
    ``.grad``."""
    found = []
    for param in _params(root, recurse):
        if not hasattr(param, "sharded_param"):
            raise _missing("the sharded parameter of an FSDPParam (sharded_param)")
        unsharded = getattr(param, "_unsharded_param", None)  # absent before the first all-gather
        if unsharded is not None:
            found.append(unsharded)
    return found


def drop_gradients(root: nn.Module) -> None:
    """Forget every gradient FSDP2 holds unreduced in ``root``'s tree: the unsharded
    parameters' ``.grad`` and the copies it accumulates in ``reduce_dtype`` across
    micro-batches that skip reduction (``unsharded_accumulated_grad``)."""
    for param in _params(root):
        if not hasattr(param, "unsharded_accumulated_grad"):
            raise _missing("the gradient it accumulates in reduce_dtype (unsharded_accumulated_grad)")
        param.unsharded_accumulated_grad = None
        unsharded = getattr(param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


def gradient_sync(root: nn.Module) -> list[bool]:
    """Whether each group of ``root``'s tree reduces its gradients (``set_requires_gradient_sync``)."""
    flags = []
    for module in sharded([root]):
        for group in _groups(module):
            flag = getattr(group, "reduce_grads", None)
            if not isinstance(flag, bool):
                raise _missing("whether a group reduces its gradients (FSDPParamGroup.reduce_grads)")
            flags.append(flag)
    return flags


def set_gradient_sync(root: nn.Module, flags: list[bool]) -> None:
    """Put back what :func:`gradient_sync` returned, group by group (public API per module)."""
    index = 0
    for module in sharded([root]):
        count = len(_groups(module))
        wanted = flags[index : index + count]
        index += count
        if wanted:
            module.set_requires_gradient_sync(all(wanted), recurse=False)  # type: ignore[operator]


def unsupported(root: nn.Module, *, finder: bool = False) -> str | None:
    """What in ``root``'s FSDP2 setup autobatch cannot keep exact, or ``None``.

    Mixed precision is supported (micro-batch gradients are weighted in ``param_dtype`` and
    accumulated in ``reduce_dtype`` as FSDP2 does itself). CPU offload is supported by the
    guard; the finder refuses it, since the sharded state it counts then lives in host memory
    while the trials measure the device. Parameters that were DTensors before ``fully_shard``
    (tensor parallelism) are refused: DTensor's own collectives run inside its operators,
    where no vote can come first.
    """
    if not callable(getattr(root, "reset_iter_state", None)):
        return (
            f"this torch's FSDP2 (torch {torch.__version__}) has no "
            "FSDPModule.reset_iter_state(), without which an iteration that another rank "
            "stopped part-way cannot be cleaned up; use a torch whose FSDP2 has it"
        )
    for module in sharded([root]):
        for group in _groups(module):
            policy = getattr(group, "offload_policy", None)
            if policy is None:
                raise _missing("a group's offload policy (FSDPParamGroup.offload_policy)")
            if finder and type(policy).__name__ == "CPUOffloadPolicy":
                return (
                    f"{type(module).__name__} offloads its sharded state to the CPU "
                    "(CPUOffloadPolicy): the finder measures one device, where that state does "
                    "not live. Search without offload (the device's memory then also holds the "
                    "sharded parameters, gradients and optimizer state), or size the batch with "
                    "retry_on_oom, which recovers under CPU offload"
                )
            for param in group.fsdp_params:
                if getattr(param, "is_dtensor", False):
                    return (
                        f"{type(module).__name__} shards parameters that were DTensors already "
                        "(tensor parallelism composed with FSDP2): DTensor issues its "
                        "collectives inside its own operators, where autobatch cannot make the "
                        "ranks agree first. Only FSDP2 over plain parameters is supported"
                    )
    return None
