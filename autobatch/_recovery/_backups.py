"""The undo store: copies of tensors taken before their first write, put back in reverse
order (in host memory when large: device memory is short, which is why a batch is split)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._recovery._rules import _key, engine_work, host_copy

_View = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def _view(tensor: torch.Tensor) -> _View:
    """Which bytes of which storage a tensor is."""
    return (
        _key(tensor), int(tensor.storage_offset()), tuple(map(int, tensor.shape)),
        tuple(map(int, tensor.stride())),
    )


#: Backups larger than this are kept in host memory, not on the device.
HOST_BACKUP_BYTES = 2**20


@dataclass
class Backups:
    """Copies of tensors taken before their first write, put back in reverse order."""

    entries: dict[_View, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def take(self, tensor: torch.Tensor, copy: torch.Tensor | None = None) -> torch.Tensor:
        view = _view(tensor)
        found = self.entries.get(view)
        if found is not None:
            return found[1]
        if copy is None:
            if tensor.numel() * tensor.element_size() > HOST_BACKUP_BYTES:
                copy = host_copy(tensor)  # (device memory is short: that is why we are here)
            else:
                with engine_work(), torch.no_grad():
                    copy = tensor.detach().clone()
        self.entries[view] = (tensor, copy)
        return copy

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return _view(tensor) in self.entries

    def put_back(self) -> None:
        with engine_work(), torch.no_grad():
            for tensor, copy in reversed(list(self.entries.values())):
                if copy.device != tensor.device:
                    with _disable_current_modes():  # (from host memory, uncounted)
                        tensor.copy_(copy)
                else:
                    tensor.copy_(copy)
        self.entries.clear()
