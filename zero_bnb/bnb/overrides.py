"""Keep bitsandbytes' per-parameter overrides working when ZeRO flattens parameter groups.

bitsandbytes looks overrides up by parameter identity (``register_module_override``,
``override_config``) or by ``(group, index)`` position (``register_parameters``). ZeRO gives
the optimizer one flat tensor per group instead of the module's parameters, so identity
lookups find nothing (the override is silently lost) and position ``(g, 0)`` would apply one
parameter's override to its whole group - worse, DeepSpeed steps the base optimizer one group
at a time with that group presented as group 0, so every position-based override lands on
``(0, 0)`` for every group. :func:`isolate_overridden_parameters` runs before DeepSpeed builds
its flat groups: each overridden parameter moves into a group of its own (same
hyper-parameters) and position-based entries are removed; :func:`attach_overrides` then
registers each override by the identity of that group's flat tensor, which is how
bitsandbytes finds it whichever position DeepSpeed presents the group at.

Local; call it on every rank (it only edits this process's optimizer and bitsandbytes' manager).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Isolation", "attach_overrides", "isolate_overridden_parameters"]

logger = logging.getLogger(__name__)


def _overrides(optimizer: Any) -> tuple[dict[int, dict[str, Any]], list[tuple[int, int]]]:
    """Parameter id -> override config, from every way bitsandbytes lets users register one; and the
    positions ``(group, index)`` of this optimizer that position-based entries applied to."""
    manager = optimizer.mng
    found: dict[int, dict[str, Any]] = {}
    positions = []
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            if (group_index, index) in manager.index2config:
                found[id(param)] = dict(manager.index2config[(group_index, index)])
                positions.append((group_index, index))
            if id(param) in manager.pid2config:
                found.setdefault(id(param), {}).update(manager.pid2config[id(param)])
    for module, attribute, config in manager.module_weight_config_triple:
        found.setdefault(id(getattr(module, attribute)), {}).update(config)
    return found, positions


@dataclass
class Isolation:
    """What :func:`isolate_overridden_parameters` changed, to attach after construction or undo on failure."""

    optimizer: Any
    groups: dict[int, dict] = field(default_factory=dict)  # flat group index -> override config
    _param_groups: list = field(default_factory=list)
    _index_entries: dict = field(default_factory=dict)
    _pid_entries: dict = field(default_factory=dict)
    _triples: list = field(default_factory=list)

    def undo(self) -> None:
        """Put the user's optimizer and bitsandbytes' manager back as they were (construction failed). Local."""
        if not self.groups:
            return
        manager = self.optimizer.mng
        self.optimizer.param_groups[:] = self._param_groups
        manager.index2config.update(self._index_entries)
        manager.pid2config.update(self._pid_entries)
        manager.module_weight_config_triple[:] = self._triples
        self.optimizer.__dict__.pop("zero_bnb_group_origin", None)
        self.groups = {}


def isolate_overridden_parameters(optimizer: torch.optim.Optimizer, names: dict[int, str], *,
                                  bitsandbytes: bool) -> Isolation:
    """Give every parameter with a bitsandbytes override a param group of its own.

    Only this optimizer's entries leave bitsandbytes' process-wide manager: the position-based
    ones that applied to its parameters (positions change with the new groups) and those
    registered for the isolated parameters; other optimizers' entries stay.

    Args:
        optimizer: the client optimizer, before ``deepspeed.initialize`` sees it.
        names: parameter id -> name, for the log.
        bitsandbytes: whether the optimizer's declared family is bitsandbytes'.

    Returns:
        The isolation: flat group index -> override config, for :func:`attach_overrides`; call
        :meth:`Isolation.undo` if the engine is not built.
    """
    isolation = Isolation(optimizer)
    if not bitsandbytes:
        return isolation
    found, positions = _overrides(optimizer)
    if not found:
        return isolation
    manager = optimizer.mng
    isolation._param_groups = list(optimizer.param_groups)
    isolation._index_entries = {position: manager.index2config[position] for position in positions}
    isolation._triples = list(manager.module_weight_config_triple)
    kept_groups, isolated, kept_origin, isolated_origin = [], [], [], []
    for origin, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        rest = [p for p in group["params"] if id(p) not in found]
        isolated += [({**hyper, "params": [p]}, p) for p in group["params"] if id(p) in found]
        isolated_origin += [origin for p in group["params"] if id(p) in found]
        if rest:
            kept_groups.append({**hyper, "params": rest})
            kept_origin.append(origin)
    optimizer.param_groups[:] = kept_groups + [group for group, _ in isolated]
    # Which of the user's param groups each group came from (per-group scheduler state of a run without isolation).
    optimizer.zero_bnb_group_origin = tuple(kept_origin + isolated_origin)
    handled = {id(p) for _, p in isolated}
    for position in positions:
        del manager.index2config[position]
    manager.module_weight_config_triple[:] = [
        triple for triple in manager.module_weight_config_triple if id(getattr(triple[0], triple[1])) not in handled
    ]
    isolation._pid_entries = {pid: manager.pid2config.pop(pid) for pid in handled if pid in manager.pid2config}
    for offset, (_, param) in enumerate(isolated):
        isolation.groups[len(kept_groups) + offset] = found[id(param)]
        logger.info("zero_bnb: %s keeps its bitsandbytes override %s in flat group %d",
                    names.get(id(param), f"parameter {tuple(param.shape)}"), found[id(param)], len(kept_groups) + offset)
    return isolation


def attach_overrides(optimizer: torch.optim.Optimizer, flat_params: list[torch.Tensor], groups: dict[int, dict]) -> None:
    """Register each isolated group's override for its flat tensor (after DeepSpeed built them)."""
    for group_index, config in groups.items():
        optimizer.mng.pid2config[id(flat_params[group_index])] = config
