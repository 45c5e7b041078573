"""ErrorFeedback's bookkeeping: residual 0 at first, x + e afterwards, updated in place, kept
per (name, hop), reset, and a clear error when a buffer changes size."""

import pytest
import torch

from fp4_comm import ErrorFeedback


def test_first_correction_is_the_payload_itself_as_a_new_float32_tensor():
    ef = ErrorFeedback()
    x = torch.arange(6, dtype=torch.bfloat16)
    c = ef.corrected("g", "worker", x)
    assert c.dtype == torch.float32 and torch.equal(c, x.float())
    x32 = torch.arange(6.0)
    c32 = ef.corrected("g", "worker", x32)
    assert c32.data_ptr() != x32.data_ptr()  # the caller's tensor is never modified


def test_residual_is_added_and_updated_in_place():
    ef = ErrorFeedback()
    x = torch.tensor([1.0, 2.0, 3.0])
    ef.store("g", "worker", ef.corrected("g", "worker", x), torch.tensor([1.0, 1.5, 4.0]))
    e = ef.residual("g")
    assert torch.equal(e, torch.tensor([0.0, 0.5, -1.0]))
    c = ef.corrected("g", "worker", x)
    assert torch.equal(c, torch.tensor([1.0, 2.5, 2.0]))
    ef.store("g", "worker", c, torch.tensor([1.0, 2.0, 2.0]))
    assert ef.residual("g") is e and torch.equal(e, torch.tensor([0.0, 0.5, 0.0]))
    assert ef.residual("g", "server") is None


def test_names_reset_and_size_mismatch():
    ef = ErrorFeedback()
    for name in ("a", "b"):
        ef.store(name, "worker", ef.corrected(name, "worker", torch.ones(4)), torch.zeros(4))
    ef.store("a", "server", ef.corrected("a", "server", torch.ones(2)), torch.zeros(2))
    assert ef.names() == ["a", "b"]
    with pytest.raises(ValueError, match="reset"):
        ef.corrected("a", "worker", torch.ones(5))
    ef.reset("a")
    assert ef.names() == ["b"] and ef.residual("a", "server") is None
    ef.reset()
    assert ef.names() == []
