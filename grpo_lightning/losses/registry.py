"""Loss registry: TRL ``loss_type`` names to classes, and name resolution."""

from __future__ import annotations

from typing import Any

from grpo_lightning.losses.base import PolicyLoss
from grpo_lightning.losses.cispo import CISPOLoss
from grpo_lightning.losses.clipped import BNPOLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, LUSPOLoss
from grpo_lightning.losses.sapo import SAPOLoss
from grpo_lightning.losses.vespo import VESPOLoss

LOSSES: dict[str, type[PolicyLoss]] = {
    cls.name: cls
    for cls in (GRPOLoss, DrGRPOLoss, DAPOLoss, BNPOLoss, CISPOLoss, SAPOLoss, LUSPOLoss, VESPOLoss)
}


def get_loss(name_or_instance: str | PolicyLoss | type[PolicyLoss], **kwargs: Any) -> PolicyLoss:
    """Resolve a loss from its registry name, its class, or an instance.

    Args:
        name_or_instance: A ``loss_type`` name (``"dapo"``, ...), a :class:`PolicyLoss` subclass,
            or an instance (returned as is).
        **kwargs: Constructor arguments (only with a name or a class).

    >>> get_loss("grpo", epsilon=0.3).epsilon
    0.3
    >>> get_loss("ppo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: model.loss='ppo': unknown loss. Valid names: ['grpo', 'dr_grpo', ..., 'vespo']; a config may also ...
    """
    if isinstance(name_or_instance, PolicyLoss):
        if kwargs:
            raise ValueError(
                f"get_loss got a {type(name_or_instance).__name__} instance and keyword arguments "
                f"{sorted(kwargs)}: set them on the instance instead."
            )
        return name_or_instance
    if isinstance(name_or_instance, type) and issubclass(name_or_instance, PolicyLoss):
        return name_or_instance(**kwargs)
    if isinstance(name_or_instance, str):
        cls = LOSSES.get(name_or_instance)
        if cls is None:
            raise ValueError(
                f"model.loss={name_or_instance!r}: unknown loss. Valid names: {list(LOSSES)}; a config may also "
                "give a class_path to a PolicyLoss subclass."
            )
        return cls(**kwargs)
    raise TypeError(
        f"Expected a loss name, a PolicyLoss subclass or instance; got {type(name_or_instance).__name__}."
    )
