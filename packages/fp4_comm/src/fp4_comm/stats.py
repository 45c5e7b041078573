"""Per-hop statistics of a compressed collective: what one encode did to its input.

Computed on request only (it costs a decode and a few reductions), as 0-d tensors on the data's
device, so asking for them adds no host synchronization; ``HopStats.as_floats`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class HopStats:
    """One hop (one encode of one rank's payload).

    Attributes:
        sqnr_db: 10 log10(sum x^2 / sum (x - x_hat)^2) over the hop's elements, in dB
            (inf where the decoded payload equals its input, an all-zero one included).
        clipped: fraction of elements encoded with their block's largest magnitude and decoded
            smaller than they were (saturated); 0 for plain-value codecs.
        zeroed: fraction of the hop's elements that are nonzero and decode to zero (over all
            its elements, as ``clipped``: not over the nonzero ones).
        elements: the number of elements (padding excluded).
    """

    sqnr_db: torch.Tensor
    clipped: torch.Tensor
    zeroed: torch.Tensor
    elements: int

    def as_floats(self) -> dict[str, float]:
        """The statistics as Python floats (a host synchronization on a GPU)."""
        return {
            "sqnr_db": float(self.sqnr_db),
            "clipped": float(self.clipped),
            "zeroed": float(self.zeroed),
            "elements": self.elements,
        }


def hop_stats(
    x: torch.Tensor,
    x_hat: torch.Tensor,
    saturated: torch.Tensor | None,
    valid: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> HopStats:
    """Statistics of ``x_hat`` (the decoded payload) against ``x``, both (chunks, n); ``valid``
    maps such a tensor to its elements that are not padding (all of them if None)."""
    if valid is None:
        valid = _all
    x = valid(x).reshape(-1).float()
    x_hat = valid(x_hat).reshape(-1).float()
    if saturated is not None:
        saturated = valid(saturated).reshape(-1)
    n = x.numel()
    # float64 sums: float32 squares of 2^20 elements would lose the small error energy.
    signal = torch.sum(x.double() ** 2)
    noise = torch.sum((x.double() - x_hat.double()) ** 2)
    # inf for noise 0 (0/0 too: an all-zero payload decoded exactly), without a sync
    sqnr_db = torch.where(noise == 0, torch.inf, 10 * torch.log10(signal / noise))
    # counts / n in float64: exact fractions for any realistic n
    zeroed = torch.sum((x != 0) & (x_hat == 0)).double() / max(n, 1)
    if saturated is None:
        clipped = torch.zeros((), dtype=torch.float64, device=x.device)
    else:
        clipped = torch.sum(saturated & (x_hat.abs() < x.abs())).double() / max(n, 1)
    return HopStats(sqnr_db, clipped, zeroed, n)


def _all(t):
    return t


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """SQNR of ``x_hat`` against ``x`` in dB, as a float (for tests and reports)."""
    if x.numel() != x_hat.numel():
        raise ValueError(f"sqnr_db: x has {x.numel()} elements, x_hat {x_hat.numel()}; the "
                         "same values before and after a round trip")  # fmt: skip
    x = x.double().reshape(-1)
    noise = float(torch.sum((x - x_hat.double().reshape(-1)) ** 2))
    signal = float(torch.sum(x**2))
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)
