"""Training with the weights stored in packed FP4: an optimizer wrapper.

``FP4StoredWeights(optimizer, rounding=...)`` wraps any ``torch.optim.Optimizer`` (SGD and AdamW
are tested).  Between steps every parameter lives only as a packed ``QuantizedTensor`` (NVFP4 by
default: 4-bit codes, an e4m3 scale per 16 weights, a float32 tensor scale: 4.5 bits a weight);
its full-precision storage is released.  ``materialize()`` (run by a forward pre-hook on every
module passed to ``attach``) decodes the weights for the forward and backward passes; ``step()``
lets the wrapped optimizer update the decoded weights in full precision, then stores the
result in FP4 again:

- ``rounding="nearest"``: round to nearest.  An update smaller than half a grid step is lost,
  every time: training stalls once the updates are small.
- ``rounding="stochastic"``: unbiased in expectation, so sub-step updates survive on average.
- ``rounding="error_feedback"``: round to nearest, carrying each weight's residual into its next
  rounding (``ErrorFeedback``): sub-step updates accumulate exactly, at the cost of a float32
  residual per weight.

The optimizer's own state (momentum, Adam moments) stays in full precision; ``memory_report``
gives every part in bytes.
"""

from __future__ import annotations

import torch

import fp4_kernels

from .error_feedback import ErrorFeedback, philox_key

ROUNDINGS = ("nearest", "stochastic", "error_feedback")


def _tensor_bytes(t):
    return t.numel() * t.element_size()


class FP4StoredWeights:
    """Keep ``optimizer``'s parameters in packed FP4 and requantize them after every update.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the parameters to store in FP4 (its
            parameter groups, learning rates and state are used as they are).
        rounding: "nearest", "stochastic" or "error_feedback" (see the module docstring).
        fmt: "nvfp4" (default) or "mxfp4".
        seed: stochastic rounding's seed (parameter i draws from its own Philox key, with the
            step count as counter).
        release: free each parameter's full-precision storage after every step (the memory
            saving); ``materialize()`` decodes it again.  With False the decoded copy is kept.

    Each parameter is flattened (row-major) and zero-padded to whole blocks, so any shape can be
    stored; a weight matrix whose rows are a multiple of the block size gets one set of blocks
    per row.  The parameters are quantized once on construction, so training starts from the
    FP4 model.
    """

    def __init__(self, optimizer, *, rounding="stochastic", fmt="nvfp4", seed=0, release=True):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding: {rounding!r} is not one of {ROUNDINGS}")
        if fmt not in fp4_kernels.FORMATS:
            raise ValueError(f"fmt: {fmt!r} is not one of {tuple(fp4_kernels.FORMATS)}")
        self.optimizer = optimizer
        self.rounding = rounding
        self.fmt = fmt
        self.seed = int(seed)
        self.release_after_step = release
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.dtypes = [p.dtype for p in self.params]
        self.step_count = 0
        self._error_feedback = (
            ErrorFeedback(fmt, "nearest") if rounding == "error_feedback" else None
        )
        self._hooks = []
        self.packed = [self._store(i, p.detach()) for i, p in enumerate(self.params)]
        self._released = [False] * len(self.params)
        self._decode_all()
        if release:
            self.release()

    # -- storage -----------------------------------------------------------------------------

    def _name(self, i):
        return f"param{i}"

    def _store(self, i, w):
        """The packed FP4 form of ``w`` (any shape): flattened, padded to whole blocks."""
        block = fp4_kernels.FORMATS[self.fmt]
        flat = w.reshape(-1).float()
        pad = -flat.numel() % block
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        step = self.step_count % 2**32
        if self.rounding == "error_feedback":
            return self._error_feedback.quantize(self._name(i), flat, step=step)
        if self.rounding == "stochastic":
            key = philox_key(self.seed, self._name(i))
            return fp4_kernels.quantize(flat, self.fmt, "stochastic", seed=key, step=step)
        return fp4_kernels.quantize(flat, self.fmt, "nearest")

    def _decoded(self, i):
        """Parameter i in full precision, decoded from its packed form (padding dropped)."""
        flat = fp4_kernels.dequantize(self.packed[i], dtype=torch.float32)
        shape = self.shapes[i]
        return flat[: _numel(shape)].view(shape).to(self.dtypes[i])

    def _decode_all(self):
        for i, p in enumerate(self.params):
            self._released[i] = False
            p.data = self._decoded(i)

    def materialize(self):
        """Decode every released parameter into full precision (for a forward pass)."""
        for i, p in enumerate(self.params):
            if self._released[i]:
                self._released[i] = False
                p.data = self._decoded(i)

    def release(self):
        """Free every parameter's full-precision storage; the packed FP4 copy remains."""
        for i, p in enumerate(self.params):
            p.data = torch.empty(0, dtype=self.dtypes[i], device=p.device)
            self._released[i] = True

    def attach(self, module):
        """Materialize the weights before each forward of ``module`` (a forward pre-hook)."""
        self._hooks.append(module.register_forward_pre_hook(lambda *_: self.materialize()))
        return module

    # -- optimizer interface -----------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of the wrapped optimizer in full precision, then store it in FP4."""
        self.materialize()
        if closure is not None:
            with torch.enable_grad():
                loss = self.optimizer.step(closure)
        else:
            loss = self.optimizer.step()
        self.step_count += 1
        for i, p in enumerate(self.params):
            self.packed[i] = self._store(i, p.detach())
        if self.release_after_step:
            self.release()
        else:
            self._decode_all()
        return loss

    # -- memory and checkpoints ---------------------------------------------------------------

    def memory_report(self):
        """Bytes of each part of the training state, now.

        ``packed_bytes``: codes + scales + tensor scales (what the weights occupy at rest);
        ``float32_bytes`` / ``bfloat16_bytes``: the same weights in float32 / bfloat16;
        ``resident_weight_bytes``: full-precision weight storage allocated now (0 once
        released); ``residual_bytes``: error feedback's residuals; ``optimizer_state_bytes``:
        the wrapped optimizer's tensors (momentum, Adam moments).
        """
        n = sum(_numel(s) for s in self.shapes)
        state_bytes = sum(
            _tensor_bytes(v)
            for s in self.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )
        ef = self._error_feedback
        return {
            "parameters": n,
            "float32_bytes": 4 * n,
            "bfloat16_bytes": 2 * n,
            "packed_bytes": sum(q.nbytes for q in self.packed),
            "resident_weight_bytes": sum(
                p.untyped_storage().nbytes() for p in self.params if p.numel()
            ),
            "residual_bytes": 0
            if ef is None
            else sum(_tensor_bytes(ef.residual(name)) for name in ef.names()),
            "optimizer_state_bytes": state_bytes,
        }

    def state_dict(self):
        """The packed weights, error feedback's residuals and the wrapped optimizer's state."""
        return {
            "rounding": self.rounding,
            "fmt": self.fmt,
            "seed": self.seed,
            "step_count": self.step_count,
            "shapes": list(self.shapes),
            "packed": [
                {
                    "data": q.data.clone(),
                    "scales": q.scales.clone(),
                    "global_scale": q.global_scale.clone(),
                    "shape": q.shape,
                }
                for q in self.packed
            ],
            "error_feedback": None
            if self._error_feedback is None
            else self._error_feedback.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state):
        """Restore ``state_dict()``; ValueError if it belongs to parameters of other shapes."""
        shapes = [tuple(s) for s in state["shapes"]]
        if len(shapes) != len(self.shapes):
            raise ValueError(
                f"the state holds {len(shapes)} parameters, this optimizer has {len(self.shapes)}"
            )
        for i, (saved, here) in enumerate(zip(shapes, self.shapes, strict=True)):
            if saved != here:
                raise ValueError(
                    f"parameter {i} has shape {here} here but {saved} in the state: "
                    "it was saved from a model of another shape"
                )
        for key in ("rounding", "fmt"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the state has {key}={state[key]!r}, this one {getattr(self, key)!r}"
                )
        self.seed = int(state["seed"])
        self.step_count = int(state["step_count"])
        device = [p.device for p in self.params]
        self.packed = [
            fp4_kernels.QuantizedTensor(
                s["data"].to(device[i]),
                s["scales"].to(device[i]),
                s["global_scale"].to(device[i]),
                self.fmt,
                tuple(s["shape"]),
                "float32",
                "linear",
            )
            for i, s in enumerate(state["packed"])
        ]
        if self._error_feedback is not None:
            self._error_feedback.load_state_dict(state["error_feedback"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._decode_all()
        if self.release_after_step:
            self.release()


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
