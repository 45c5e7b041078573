"""hop_stats on inputs whose statistics are known by hand."""

import math

import torch

from fp4_comm.stats import hop_stats, sqnr_db


def test_known_values():
    x = torch.tensor([[3.0, 4.0, 0.0, 1.0, 8.0, 0.5]])
    x_hat = torch.tensor([[3.0, 4.0, 0.0, 0.0, 6.0, 0.5]])
    saturated = torch.tensor([[False, False, False, False, True, True]])
    s = hop_stats(x, x_hat, saturated).as_floats()
    signal, noise = 9 + 16 + 1 + 64 + 0.25, 1 + 4
    assert s["sqnr_db"] == 10 * math.log10(signal / noise)
    assert s["zeroed"] == 1 / 6  # 1.0 became 0; the 0 that stayed 0 does not count
    assert s["clipped"] == 1 / 6  # 8 -> 6 at the top code; 0.5 at the top code but not smaller
    assert s["elements"] == 6


def test_padding_excluded_and_exact_payloads():
    x = torch.tensor([[1.0, 2.0, 7.0, 7.0]])
    x_hat = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    s = hop_stats(x, x_hat, None, lambda t: t.reshape(-1)[:2]).as_floats()
    assert s == {"sqnr_db": math.inf, "clipped": 0.0, "zeroed": 0.0, "elements": 2}
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, x_hat) == 10 * math.log10(103 / 98)


def test_an_exact_all_zero_hop_has_an_infinite_sqnr():
    """0/0 gave NaN where the docstring (and stats.sqnr_db) say inf: the payload decoded
    exactly."""
    import torch

    from fp4_comm.stats import hop_stats

    z = torch.zeros(64)
    s = hop_stats(z, z.clone(), None)
    assert s.sqnr_db.item() == float("inf") and s.zeroed.item() == 0.0


def test_sqnr_db_of_other_sizes_is_refused_and_of_zero_signal_is_minus_inf():
    """Broadcast (4 against 1 element) gave a number; a zero signal raised math's domain
    error where hop_stats gives -inf."""
    import pytest

    with pytest.raises(ValueError, match="x has 4 elements, x_hat 1"):
        sqnr_db(torch.randn(4), torch.randn(1))
    assert sqnr_db(torch.zeros(4), torch.ones(4)) == -math.inf
    assert sqnr_db(torch.zeros(4), torch.zeros(4)) == math.inf
