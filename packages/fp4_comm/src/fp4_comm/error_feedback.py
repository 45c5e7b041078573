"""Error feedback for compressed reductions, per named buffer.

As in error-feedback SGD (Seide et al. 2014; Karimireddy et al. 2019): what one quantization of
a buffer lost, e = x_corrected - decode(encode(x_corrected)), is added to that buffer before
its next quantization, so the errors do not accumulate over steps: the sum over T steps of the
transmitted values differs from the sum of the inputs by one residual, not T of them.

A compressed all-reduce quantizes twice, so a buffer has two residuals: the worker residual
(each rank's whole input, before the exchange) and the server residual (the chunk a rank
reduces, before the all-gather).  Reduce-scatter has only the worker residual.

Non-finite values: a block (the codec's block of elements) whose input holds NaN or Inf
decodes to NaN (``docs/formats.md``), so its residual would be NaN, and NaN added to every
later payload of the buffer would make that block NaN forever.  Such a block's residual is
reset to 0 instead and counted (``nonfinite_blocks``; on CPU tensors also a RuntimeWarning):
the step that overflowed gives non-finite values, as it would without compression (a
GradScaler skips it), and the next step starts that block afresh.

CUDA graphs: a residual tensor, once made, keeps its storage.  ``store`` overwrites it in
place, ``reset`` fills it in place with -0.0 (x + (-0.0) is x, bit for bit, -0 included: the
value of a fresh start) and ``load_state_dict`` copies into it, so a collective replayed from a
graph reads and writes the tensors it was captured with.  Only a residual that a payload of
another shape replaces (after a ``reset``), or one that ``load_state_dict`` brings with another
shape, gets new storage; ``in_use`` lets a graph's owner see that.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from .codecs import check_float_tensor

Hop = Literal["worker", "server"]

HOPS = ("worker", "server")


class ErrorFeedback:
    """Residuals keyed by (buffer name, hop); float32, on the data's device, padded like the
    payload (the padding's residual stays 0: zeros encode exactly)."""

    def __init__(self) -> None:
        self._residuals: dict[tuple[str, str], torch.Tensor] = {}
        # Blocks reset for holding NaN/Inf, per (name, hop): int64 0-d tensors on the residual's
        # device, so that counting needs no host synchronization on a GPU.
        self._nonfinite: dict[tuple[str, str], torch.Tensor] = {}
        # Keys reset since their last use: their tensors hold -0.0 and 0, kept for graphs.
        self._cleared: set[tuple[str, str]] = set()

    def corrected(self, name: str, hop: Hop, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float, any shape) plus the stored residual of (name, hop), in float32; a new
        tensor.  The first call of a name starts from residual 0."""
        key = (name, hop)
        e = self._residuals.get(key)
        if key in self._cleared:
            self._cleared.discard(key)
            if e.shape != x.shape or e.device != x.device:  # a new buffer under a reset name
                del self._residuals[key], self._nonfinite[key]
                e = None
        if e is None:
            return x.clone() if x.dtype == torch.float32 else x.float()
        if e.shape != x.shape or e.device != x.device:
            raise ValueError(
                f"error feedback {name!r} ({hop}): the residual has shape {tuple(e.shape)} on "
                f"{e.device}, this payload {tuple(x.shape)} on {x.device}; use another name "
                "per buffer, or reset(name) when a buffer changes size"
            )
        return x + e  # bfloat16/float16 + float32 promotes to float32: one op, a new tensor

    def store(
        self,
        name: str,
        hop: Hop,
        corrected: torch.Tensor,
        decoded: torch.Tensor,
        block_size: int = 1,
    ) -> None:
        """Keep corrected - decoded as the residual of (name, hop); ``corrected`` is consumed.

        Every run of ``block_size`` elements (the codec's block; the residual's element count
        is a multiple of it) that holds a NaN or an Inf gets residual 0, and is counted.

        An existing residual is overwritten in place, so a collective captured in a CUDA graph
        reads and writes the same residual tensor on every replay (the reset is in place too,
        and needs no host synchronization)."""
        # checked before any state changes (a residual stored without its count made
        # state_dict() fail later)
        if not isinstance(name, str):
            raise TypeError(f"name: a buffer name (str), got {type(name).__name__}")
        if hop not in HOPS:
            raise ValueError(f"hop: {hop!r} is not one of {HOPS}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: a positive int, got {block_size!r}")
        what = f"error feedback {name!r} ({hop})"
        if corrected.dtype != torch.float32 or not corrected.is_contiguous():
            raise ValueError(f"{what}: corrected is a {corrected.dtype} tensor"
                             f"{'' if corrected.is_contiguous() else ', not contiguous'}; "
                             "the residual is float32, laid out as it")  # fmt: skip
        if decoded.shape != corrected.shape:
            raise ValueError(f"{what}: decoded has shape {tuple(decoded.shape)}, corrected "
                             f"{tuple(corrected.shape)}: one payload's values")  # fmt: skip
        if corrected.numel() % block_size:
            raise ValueError(f"{what}: {corrected.numel()} elements are "
                             f"no whole number of blocks of {block_size}")  # fmt: skip
        key = (name, hop)
        e = self._residuals.get(key)
        if e is not None and e.shape != corrected.shape:
            if key not in self._cleared:
                raise ValueError(f"{what}: the residual has shape {tuple(e.shape)}, this call "
                                 f"{tuple(corrected.shape)}; reset({name!r}) for a buffer of "
                                 "another shape")  # fmt: skip
            e = None  # reset: a payload of another shape replaces it (new storage)
        self._cleared.discard(key)
        if e is None:
            e = self._residuals[key] = corrected.sub_(decoded)
        else:
            torch.sub(corrected, decoded, out=e)
        blocks = e.view(-1, block_size)
        bad = ~torch.isfinite(blocks).all(dim=1, keepdim=True)
        blocks.masked_fill_(bad, 0.0)
        n_bad = bad.sum()
        count = self._nonfinite.get(key)
        if count is None:
            self._nonfinite[key] = n_bad
        else:
            count.add_(n_bad)
        n = int(n_bad) if e.device.type == "cpu" else 0  # no host synchronization on a GPU
        if n:
            warnings.warn(
                f"error feedback {name!r} ({hop}): {n} block(s) of {block_size} "
                "held NaN or Inf (their result is NaN); their residual was reset to 0",
                RuntimeWarning,
                stacklevel=2,
            )

    def residual(self, name: str, hop: Hop = "worker") -> torch.Tensor | None:
        """The stored residual (None before the first use of the name, and after its reset)."""
        return None if (name, hop) in self._cleared else self._residuals.get((name, hop))

    def in_use(self, name: str) -> tuple[torch.Tensor, ...]:
        """The residual and count tensors of ``name``, every hop that has one (reset ones
        included): what a collective captured in a CUDA graph reads and writes in place.  A
        graph whose tensors are no longer these (``is``) must not be replayed."""
        out = []
        for key in sorted(k for k in self._residuals if k[0] == name):
            out += [self._residuals[key], self._nonfinite[key]]
        return tuple(out)

    def resume(self, name: str) -> None:
        """Take the reset residuals of ``name`` back in use, as a call of the name does: what
        a replayed graph's call, which updates them in place, tells this object."""
        self._cleared -= {k for k in self._cleared if k[0] == name}

    def nonfinite_blocks(self, name: str | None = None) -> int:
        """How many blocks of ``name`` (every name if None) had their residual reset for holding
        NaN or Inf, since the first use or the last ``reset``.  Reads GPU counters: a
        synchronization where the residuals live on a GPU."""
        return sum(int(n) for (k, _), n in self._nonfinite.items() if name is None or k == name)

    def reset(self, name: str | None = None) -> None:
        """Forget the residuals and counts of ``name`` (every name if None): the next call of
        the name starts from residual 0.  In place (the module's docstring says why): the
        tensors are filled with -0.0 and 0 on their stream, and kept for a payload of their
        shape; one of another shape replaces them."""
        for key in [k for k in self._residuals if name is None or k[0] == name]:
            self._residuals[key].fill_(-0.0)
            self._nonfinite[key].zero_()
            self._cleared.add(key)

    def names(self) -> list[str]:
        """The buffer names that have a residual, sorted."""
        return sorted({k[0] for k in self._residuals if k not in self._cleared})

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The residuals (copies, on their devices) and the non-finite counts, as nested dicts
        of names, tensors and ints that ``torch.save`` writes and ``torch.load(...,
        weights_only=True)`` reads: ``load_state_dict`` of it into a new ``ErrorFeedback``
        continues with the very same bits."""
        residuals: dict[str, dict[str, torch.Tensor]] = {}
        counts: dict[str, dict[str, int]] = {}
        for (name, hop), e in self._residuals.items():
            if (name, hop) not in self._cleared:
                residuals.setdefault(name, {})[hop] = e.detach().clone()
                counts.setdefault(name, {})[hop] = int(self._nonfinite[(name, hop)])
        return {"residuals": residuals, "nonfinite_blocks": counts}

    def load_state_dict(self, state: dict) -> None:
        """Replace every residual and count with those of ``state`` (from ``state_dict``;
        tensors are copied, and stay on the device they come on: ``torch.load``'s
        ``map_location`` moves them).  A residual of the same shape and device as the one held
        is copied into it (in place, on the stream); names ``state`` lacks are reset."""
        what = "ErrorFeedback.load_state_dict"
        if not isinstance(state, dict) or set(state) != {"residuals", "nonfinite_blocks"}:
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{what}: expected a dict with the keys 'residuals' and 'nonfinite_blocks' "
                f"(ErrorFeedback.state_dict()), got {keys}"
            )
        residuals, counts = {}, {}
        for (name, hop), e in _entries(state["residuals"], "residuals"):
            if not isinstance(e, torch.Tensor) or e.dtype != torch.float32:
                kind = getattr(e, "dtype", type(e).__name__)
                raise TypeError(f"{what}: residuals[{name!r}][{hop!r}] is {kind}, not a "
                                "float32 tensor")  # fmt: skip
            check_float_tensor(f"{what}: residuals[{name!r}][{hop!r}]", e)  # nested, sparse
            if e.is_meta:
                raise TypeError(f"{what}: residuals[{name!r}][{hop!r}] is a meta tensor; "
                                "expected one holding its values")  # fmt: skip
            residuals[(name, hop)] = e
        for key, n in _entries(state["nonfinite_blocks"], "nonfinite_blocks"):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**63:
                raise TypeError(f"{what}: nonfinite_blocks[{key[0]!r}][{key[1]!r}] is {n!r}, "
                                "not a count (an int in [0, 2**63))")  # fmt: skip
            if key not in residuals:
                raise ValueError(f"{what}: nonfinite_blocks[{key[0]!r}][{key[1]!r}] has no "
                                 "residual")  # fmt: skip
            counts[key] = n
        self.reset()
        for key, e in residuals.items():
            self._load(key, e, counts.get(key, 0))

    def _load(self, key, e, count):
        """Hold ``e`` (a float32 tensor) and ``count`` for ``key``: copied into the tensors
        held where their shape and device allow."""
        held = self._residuals.get(key)
        if held is not None and held.shape == e.shape and held.device == e.device:
            held.copy_(e)
            self._nonfinite[key].fill_(count)
        else:
            self._residuals[key] = e.detach().clone().contiguous()
            self._nonfinite[key] = torch.tensor(count, dtype=torch.int64, device=e.device)
        self._cleared.discard(key)


def _entries(d, where):
    """((name, hop), value) of a {name: {hop: value}} dict, checked."""
    if not isinstance(d, dict):
        raise TypeError(f"ErrorFeedback.load_state_dict: {where} is {type(d).__name__}, not a "
                        "dict")  # fmt: skip
    for name, hops in d.items():
        if not isinstance(hops, dict) or not set(hops) <= set(HOPS):
            raise ValueError(
                f"ErrorFeedback.load_state_dict: {where}[{name!r}] should map hops {HOPS} to "
                f"values, got {hops!r:.200}"
            )
        for hop, value in hops.items():
            yield (name, hop), value
