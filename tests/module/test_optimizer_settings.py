"""`model.optimizer` with a non-default learning_rate/weight_decay is an error (they were silently ignored)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from tests.helpers import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("optimizer") / "model")


@pytest.mark.parametrize("kwargs, named", [
    ({"learning_rate": 1e-3}, "model.learning_rate=0.001"),
    ({"weight_decay": 0.1}, "model.weight_decay=0.1"),
])
def test_optimizer_with_default_optimizer_settings_is_an_error(model_dir, kwargs, named):
    with pytest.raises(ConfigError, match=named) as info:
        GRPOModule(model_dir, optimizer=partial(torch.optim.SGD, lr=0.1), **kwargs)
    assert "model.optimizer" in str(info.value) and "init_args" in str(info.value)


def test_optimizer_alone_or_settings_alone_are_fine(model_dir):
    GRPOModule(model_dir, optimizer=partial(torch.optim.SGD, lr=0.1))
    GRPOModule(model_dir, learning_rate=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("kwargs, message", [
    ({"weight_decay": -0.1}, r"model\.weight_decay=-0\.1: it must be >= 0"),
    ({"warmup_steps": -5}, r"model\.warmup_steps=-5: it must be >= 0"),
    ({"optimizer": partial(torch.optim.SGD, lr=-0.1)}, r"model\.optimizer\.init_args\.lr=-0\.1: it must be > 0"),
    ({"optimizer": partial(torch.optim.AdamW, lr=1e-3, weight_decay=-1.0)},
     r"model\.optimizer\.init_args\.weight_decay=-1\.0: it must be >= 0"),
])
def test_negative_optimizer_settings_fail_at_construction(model_dir, kwargs, message):
    """Before the model loads, not as torch's traceback once the optimizer is built."""
    with pytest.raises(ValueError, match=message):
        GRPOModule(model_dir, **kwargs)


def test_bad_model_init_kwargs_name_the_setting(model_dir):
    module = GRPOModule(model_dir, model_init_kwargs={"attn_implementation": "no_such_kernel"}, save_final_model=False)
    with pytest.raises(ValueError, match=r"model\.model_init_kwargs=\{'attn_implementation': 'no_such_kernel'\}: "
                                         r"AutoModelForCausalLM\.from_pretrained\(.*\) failed with them"):
        module.configure_model()
