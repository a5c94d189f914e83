"""Update partitions larger than bitsandbytes' kernels can address, in block-aligned pieces.

bitsandbytes' update kernels take a 32-bit element count, so one tensor above 2^31 elements
(a 7B model at DP=1, a 70B one at DP=8) is not updated correctly. :class:`ChunkedUpdate`
replaces an optimizer's ``update_step`` so that such a partition is updated as consecutive
pieces of at most ``limit`` elements, each starting on a quantization block: every piece
sees exactly its own elements, gradients, 8-bit codes and per-block ``absmax``, and the
shared maps and step count, so the result is the one a kernel without the limit would give.
The engine installs it on every bitsandbytes optimizer with the ``zero_update_max_numel``
setting as ``limit`` (default: the kernels' limit).

Local: no collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_bnb.core.kinds import is_partitioned, to_axis
from zero_bnb.core.state_spec import BNB_KERNEL_MAX_NUMEL, OptimizerSpec, StateKind

__all__ = ["ChunkedUpdate", "uninstall_chunked_update"]


class ChunkedUpdate:
    """A replacement for ``optimizer.update_step`` that splits partitions above ``limit`` elements.

    Install with ``optimizer.update_step = ChunkedUpdate(optimizer, spec)``. Partitions at or
    under the limit take the original path unchanged.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, spec: OptimizerSpec, limit: int = BNB_KERNEL_MAX_NUMEL) -> None:
        if limit < spec.block_size:
            raise ValueError(f"limit {limit} is smaller than one quantization block ({spec.block_size} elements)")
        self.optimizer = optimizer
        self.spec = spec
        self.limit = limit - limit % spec.block_size
        self.original = optimizer.update_step

    def _piece_state(self, state: dict[str, Any], start: int, end: int) -> dict[str, Any]:
        block = self.spec.block_size
        piece = {}
        for key, value in state.items():
            kind = self.spec.kinds.get(key)
            if kind is not None and is_partitioned(kind):
                if value.dim() > 1:
                    raise ValueError(
                        f"state {key!r} has shape {tuple(value.shape)}: pieces of its last axis are not contiguous, "
                        f"so a partition above {self.limit} elements cannot be updated in pieces; use a larger DP size"
                    )
                first, last = to_axis(kind, start, end, block)
                piece[key] = value[..., first:last]
                if getattr(value, "is_paged", False):  # bitsandbytes' CUDA path takes paged state by this tag only
                    piece[key].is_paged = True
                    piece[key].page_deviceid = getattr(value, "page_deviceid", None)
            elif kind is StateKind.PARTITION_SCALAR:
                raise ValueError(f"state {key!r} holds one value for the whole partition; it cannot be updated in pieces")
            else:
                piece[key] = value
        return piece

    def __call__(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> Any:
        numel = p.numel()
        if numel <= self.limit:
            return self.original(group, p, gindex, pindex)
        state = self.optimizer.state[p]
        step = state["step"]
        values, grads = p.data.view(-1), p.grad.view(-1)
        for start in range(0, numel, self.limit):
            end = min(start + self.limit, numel)
            piece = torch.nn.Parameter(values[start:end], requires_grad=p.requires_grad)
            piece.grad = grads[start:end]
            self.optimizer.state[piece] = self._piece_state(state, start, end)
            try:
                self.original(group, piece, gindex, pindex)  # writes through the views into p and its state
            finally:
                del self.optimizer.state[piece]
        state["step"] = step + 1
        return None


def uninstall_chunked_update(optimizer: Any) -> None:
    """Remove a :class:`ChunkedUpdate` installed on ``optimizer`` (its class's ``update_step`` applies again)."""
    if isinstance(optimizer.__dict__.get("update_step"), ChunkedUpdate):
        del optimizer.update_step
