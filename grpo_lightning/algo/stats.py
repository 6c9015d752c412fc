"""NaN-aware and masked reductions shared by the advantage and loss code.

Layer L0: torch and the standard library only. The NaN conventions follow TRL's
``trl.trainer.utils`` (``nanstd`` is unbiased and NaN below two values; ``nanmin``/``nanmax``
return NaN when every value is NaN), so that numbers computed here match TRL's logs.
"""

from __future__ import annotations

import torch


def nanstd(
    tensor: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False
) -> torch.Tensor:
    """Unbiased (Bessel-corrected) standard deviation that ignores NaNs.

    Args:
        tensor: Input values; NaN marks a missing value.
        dim: Dimension(s) to reduce; ``None`` reduces all of them.
        keepdim: Keep the reduced dimensions with size 1.

    Returns:
        The standard deviation; NaN wherever fewer than two non-NaN values were reduced.

    >>> float(nanstd(torch.tensor([1.0, float("nan"), 3.0])))
    1.4142135381698608
    >>> nanstd(torch.tensor([[1.0, 2.0], [5.0, float("nan")]]), dim=1)
    tensor([0.7071,    nan])
    """
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    if dim is None:
        return std.squeeze()
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in sorted((d % std.ndim for d in dims), reverse=True):
        std = std.squeeze(d)
    return std


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """Minimum over all elements ignoring NaNs; NaN when there is no non-NaN value.

    >>> float(nanmin(torch.tensor([float("nan"), 2.0, 1.0])))
    1.0
    >>> nanmin(torch.tensor([float("nan")])).isnan().item()
    True
    """
    return _nan_extreme(tensor, float("inf"), torch.min)


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum over all elements ignoring NaNs; NaN when there is no non-NaN value.

    >>> float(nanmax(torch.tensor([float("nan"), 2.0, 1.0])))
    2.0
    """
    return _nan_extreme(tensor, float("-inf"), torch.max)


def _nan_extreme(tensor: torch.Tensor, fill: float, reduce) -> torch.Tensor:
    # Without boolean indexing, so that no device-to-host sync is needed.
    nan = torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    if tensor.numel() == 0:
        return nan
    is_nan = torch.isnan(tensor)
    extreme = reduce(torch.where(is_nan, torch.full_like(tensor, fill), tensor))
    return torch.where(is_nan.all(), nan, extreme)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ values·mask`` over ``dim`` (all elements when ``None``); ``values`` may broadcast.

    >>> float(masked_sum(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]])))
    1.0
    """
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ values·mask / max(Σ mask, 1)`` over ``dim`` (all elements when ``None``).

    The denominator is clamped at 1 (TRL's convention), so an empty mask gives 0, not NaN.
    ``values`` may be ``(B, 1)`` and broadcast against a ``(B, T)`` mask.

    >>> m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    >>> masked_mean(torch.tensor([[1.0, 3.0, 9.0], [5.0, 5.0, 5.0]]), m, dim=1)
    tensor([2., 0.])
    """
    mask = mask.to(values.dtype) if values.is_floating_point() else mask.float()
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)
