"""Optimizer offload without an engine: what zero_bnb accepts and refuses in ``offload_optimizer``, and
Accelerate's swap to ``DeepSpeedCPUAdam`` kept off while zero_bnb routes ``deepspeed.initialize`` (the
engines run in ``tests/test_optimizers.py`` and the front-door launches)."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from zero_bnb.core.config import FORCE_DS_CPU_OPTIMIZER, ZeroBnbConfigError, prepare_offload
from zero_bnb.core.state_spec import UnsupportedOptimizerError


def _optimizer():
    return bnb.optim.Adam8bit([torch.nn.Parameter(torch.zeros(8))])


@pytest.mark.parametrize("zero", [
    {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False, "ratio": 1}},
    {"stage": 2, "cpu_offload": True},  # DeepSpeed's deprecated spelling
    # Lightning's strategy writes an nvme_path and a buffer count even for the CPU: harmless, accepted.
    {"stage": 2, "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 4}},
])
def test_cpu_offload_is_accepted_and_lets_deepspeed_take_the_client_optimizer(zero):
    config = {"zero_optimization": zero}
    assert prepare_offload(config, _optimizer()) is True
    assert config[FORCE_DS_CPU_OPTIMIZER] is False


@pytest.mark.parametrize("zero", [
    {"stage": 1}, {"stage": 2, "offload_optimizer": None}, {"stage": 2, "offload_optimizer": {"device": "none"}},
    {"stage": 2, "offload_param": {"device": "none"}},
])
def test_no_offload_leaves_the_config_alone(zero):
    config = {"zero_optimization": dict(zero)}
    assert prepare_offload(config, _optimizer()) is False
    assert config == {"zero_optimization": zero}


def test_an_explicit_false_is_kept_and_no_client_optimizer_sets_nothing():
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, FORCE_DS_CPU_OPTIMIZER: False}
    assert prepare_offload(config, _optimizer()) and config[FORCE_DS_CPU_OPTIMIZER] is False
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert prepare_offload(config, None) and FORCE_DS_CPU_OPTIMIZER not in config  # DeepSpeed builds its CPU Adam


@pytest.mark.parametrize(("config", "parts"), [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}},
     ['offload_optimizer.device="nvme"', "skips the optimizer state", 'Set "device": "cpu"']),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     ["offload_optimizer.device must be \"cpu\" or \"none\"", "'gpu'"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     ["ratio=0.3", "partial offload", "remove ratio"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
     ["super_offload=true", "remove it"]),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}},
     ["offload_param.device='nvme'", "stage 3", "remove offload_param"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}},
     ["offload_optimizer must be an object", "'cpu'"]),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}, FORCE_DS_CPU_OPTIMIZER: True},
     ["zero_force_ds_cpu_optimizer=True", "bitsandbytes.optim.adam.Adam8bit", "DeepSpeedCPUAdam", "remove the key"]),
])
def test_what_deepspeed_cannot_do_at_stages_1_and_2_is_refused_naming_the_setting(config, parts):
    before = repr(config)
    with pytest.raises(ZeroBnbConfigError) as refused:
        prepare_offload(config, _optimizer())
    for part in parts:
        assert part in str(refused.value), (part, str(refused.value))
    assert repr(config) == before  # nothing was changed


@pytest.mark.parametrize("force", [None, True])
def test_an_optimizer_zero_bnb_does_not_declare_is_refused_under_offload_before_deepspeed_asks_for_its_own(force):
    """zero_bnb's refusal, with the supported list, not DeepSpeed's "set zero_force_ds_cpu_optimizer: false"."""
    config = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    if force is not None:
        config[FORCE_DS_CPU_OPTIMIZER] = force
    with pytest.raises(UnsupportedOptimizerError, match=r"no state declaration for bitsandbytes\.optim\.lamb\.LAMB8bit"
                                                        r"\. Supported: .*Adam"):
        prepare_offload(config, bnb.optim.LAMB8bit([torch.nn.Parameter(torch.zeros(8))]))
    assert config.get(FORCE_DS_CPU_OPTIMIZER) is force


def test_an_optimizer_factory_under_offload_is_left_for_deepspeed_to_build_and_zero_bnb_to_check():
    """DeepSpeed accepts a callable that builds the optimizer; its family is checked once it is built."""
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert prepare_offload(config, lambda params: bnb.optim.LAMB8bit(params)) is True
    assert config[FORCE_DS_CPU_OPTIMIZER] is False


def test_accelerate_keeps_the_users_optimizer_only_while_zero_bnb_routes_the_call():
    """Accelerate and Trainer call accelerate.accelerator.map_pytorch_optim_to_deepspeed under offload."""
    import accelerate.accelerator
    from accelerate.utils import map_pytorch_optim_to_deepspeed

    import zero_bnb

    lamb = bnb.optim.LAMB8bit([torch.nn.Parameter(torch.zeros(8))])  # not declared: zero_bnb must see it to name it
    for optimizer in (_optimizer(), lamb):
        with zero_bnb.enabled():
            assert accelerate.accelerator.map_pytorch_optim_to_deepspeed(optimizer) is optimizer
    # Outside routing Accelerate's own function is back in place (it would build DeepSpeedCPUAdam).
    assert accelerate.accelerator.map_pytorch_optim_to_deepspeed is map_pytorch_optim_to_deepspeed
    zero_bnb.enable()
    try:
        assert accelerate.accelerator.map_pytorch_optim_to_deepspeed(lamb) is lamb
    finally:
        zero_bnb.disable()
    assert accelerate.accelerator.map_pytorch_optim_to_deepspeed is map_pytorch_optim_to_deepspeed
