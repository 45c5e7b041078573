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

Checkpoints: ``module.state_dict()`` of a module passed to ``attach`` holds the decoded weights
(ordinary tensors of the parameters' shapes and dtypes, loadable into the same model without
FP4StoredWeights), and ``module.load_state_dict()`` stores the loaded weights in FP4.
``FP4StoredWeights.state_dict()`` holds the packed weights themselves, the residuals and the
wrapped optimizer's state: restoring it resumes training bit for bit.  As torch's
``Optimizer.state_dict()``, the optimizer's part holds its live tensors (momentum, moments),
which later steps change: ``torch.save`` the state, or ``copy.deepcopy`` it to keep it in memory.

A parameter that an update leaves unchanged (no gradient) keeps its packed form; a changed
bfloat16 / float16 parameter is stored as its FP4 value plus the update, in float32 (its own
dtype holds the FP4 value rounded, whose error would otherwise be requantized every step).  The
parameters keep the dtype and device they had when the optimizer was wrapped: convert or move
the model first (``model.half()``, ``model.cuda()``); a change after is refused (ValueError).
A wrapper that is dropped without ``attach`` decodes its released parameters back into full
precision (an attached module keeps its wrapper alive).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

import fp4_kernels
from fp4_kernels.formats import e2m1

from .error_feedback import (
    ErrorFeedback,
    check_integer,
    check_seed,
    check_state_keys,
    check_storage,
    philox_key,
)

ROUNDINGS = e2m1.ROUNDINGS + ("error_feedback",)
# the per-parameter states that torch.optim's optimizers keep in the parameter's shape
# (SGD, RMSprop, Muon: momentum_buffer; Adam, AdamW, NAdam, RAdam, Adamax: exp_avg; ...)
_PARAMETER_SHAPED_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _tensor_bytes(t):
    return t.numel() * t.element_size()


class FP4StoredWeights:
    """Keep ``optimizer``'s parameters in packed FP4 and requantize them after every update.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the parameters to store in FP4 (its
            parameter groups, learning rates and state are used as they are); the parameters
            are real floating-point tensors (float32, bfloat16, float16 or float64).
        rounding: "nearest", "stochastic" or "error_feedback" (see the module docstring).
        fmt: "nvfp4" (default) or "mxfp4".
        seed: stochastic rounding's seed, an int in [0, 2**64) (parameter i draws from its own
            Philox key, with the step count modulo 2**32 as counter).
        release: free each parameter's full-precision storage after every step (the memory
            saving); ``materialize()`` decodes it again.  With False the decoded copy is kept.
            A released parameter is an empty tensor: an operation on it that fails (a forward
            through a model not passed to ``attach``) raises an error that says so.

    Each parameter is flattened (row-major) and zero-padded to whole blocks, so any shape can be
    stored; a weight matrix whose rows are a multiple of the block size gets one set of blocks
    per row.  The parameters are quantized once on construction, so training starts from the
    FP4 model.  A NaN or infinite weight makes its whole block (16 or 32 weights) decode to NaN
    (fp4_kernels' non-finite policy); nothing checks for it, as a full-precision optimizer
    would not.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        rounding: Literal["nearest", "stochastic", "error_feedback"] = "stochastic",
        fmt: Literal["nvfp4", "mxfp4"] = "nvfp4",
        seed: int = 0,
        release: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer: expected a torch.optim.Optimizer over the parameters to store, got "
                f"{type(optimizer).__name__} (wrap them first: torch.optim.SGD(params, lr=...))"
            )
        if not isinstance(rounding, str) or rounding not in ROUNDINGS:
            raise ValueError(f"rounding: {rounding!r} is not one of {ROUNDINGS}")
        if not isinstance(fmt, str) or fmt not in fp4_kernels.FORMATS:
            raise ValueError(f"fmt: {fmt!r} is not one of {tuple(fp4_kernels.FORMATS)}")
        if not isinstance(release, bool):
            raise TypeError(f"release: expected True or False, got {release!r}")
        self.optimizer = optimizer
        self.rounding = rounding
        self.fmt = fmt
        self.seed = check_seed(seed)
        self.release_after_step = release
        wrapper = _WRAPPERS.get(optimizer)
        if wrapper is not None and wrapper() is not None:
            raise ValueError(
                "optimizer: it is wrapped by an FP4StoredWeights already (which holds its "
                "parameters in FP4); wrap an optimizer once and use that wrapper"
            )
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(self.params):
            if type(p) in _PLAIN_CLASS:
                raise ValueError(
                    f"parameter {i} is stored in FP4 by another FP4StoredWeights (its "
                    "full-precision storage is released); a parameter is stored by one"
                )
            check_storage(p, f"parameter {i}")
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; FP4 storage "
                    "holds real floating-point parameters (float32, bfloat16, float16, float64)"
                )
        self.shapes = [tuple(p.shape) for p in self.params]
        self.dtypes = [p.dtype for p in self.params]
        self.devices = [p.device for p in self.params]
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
        _WRAPPERS[optimizer] = weakref.ref(self)
        # (the lists are changed in place, never replaced: the finalizer holds them, not self)
        done = weakref.finalize(self, _materialize, self.params, self.packed, self._released,
                                self.shapes, self.dtypes, range(len(self.params)))  # fmt: skip
        done.atexit = False

    # -- storage -----------------------------------------------------------------------------

    def _name(self, i):
        return f"param{i}"

    def _padded_shape(self, i):
        """The shape of parameter i's packed form: flattened, padded to whole blocks."""
        block = fp4_kernels.FORMATS[self.fmt]
        return (-(-_numel(self.shapes[i]) // block) * block,)

    def _check_residuals(self, residuals):
        """ValueError unless each of a state's error-feedback ``residuals`` (name -> tensor,
        finite: ``ErrorFeedback._checked_state`` checked them) is a torch tensor, belongs to a
        parameter here and has its flattened, block-padded shape; each is moved to its
        parameter's device."""
        names = {self._name(i): i for i in range(len(self.params))}
        for name, r in residuals.items():
            what = f"state['error_feedback']['residuals'][{name!r}]"
            if name not in names:
                raise ValueError(f"{what}: no such parameter here (param0 .. "
                                 f"param{len(self.params) - 1})")  # fmt: skip
            i = names[name]
            if not isinstance(r, torch.Tensor):
                raise ValueError(f"{what}: {type(r).__name__}; expected the torch tensor that "
                                 "state_dict() holds")  # fmt: skip
            residuals[name] = r.to(self.devices[i])  # where its parameter lives
            padded = self._padded_shape(i)
            if tuple(r.shape) != padded:
                raise ValueError(
                    f"{what}: shape {tuple(r.shape)}, expected {padded} (parameter {i} of "
                    f"shape {self.shapes[i]}, flattened and padded to whole blocks)"
                )

    def _store(self, i, w):
        """The packed FP4 form of ``w`` (any shape): flattened, padded to whole blocks."""
        block = fp4_kernels.FORMATS[self.fmt]
        flat = w.reshape(-1).resolve_neg().float()
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
        return _decode(self.packed[i], self.shapes[i]).to(self.dtypes[i])

    def _check_unmoved(self, what):
        """ValueError naming the first parameter whose dtype or device changed since it was
        stored (``model.half()`` / ``.cuda()`` after wrapping: decoding would undo it)."""
        for i, p in enumerate(self.params):
            if p.dtype != self.dtypes[i] or p.device != self.devices[i]:
                raise ValueError(
                    f"{what}: parameter {i} is {p.dtype} on {p.device} now, but was stored in FP4 "
                    f"as {self.dtypes[i]} on {self.devices[i]}: convert or move the model "
                    "(.half(), .to(...), .cuda()) before wrapping its optimizer in "
                    "FP4StoredWeights"
                )

    def _decode_all(self):
        self._materialize(range(len(self.params)), force=True)

    def _materialize(self, indices, force=False):
        _materialize(self.params, self.packed, self._released, self.shapes, self.dtypes, indices,
                     force)  # fmt: skip

    def _release(self, indices):
        for i in indices:
            p = self.params[i]
            p.data = torch.empty(0, dtype=self.dtypes[i], device=p.device)
            if not self._released[i]:
                _mark_released(p, True)
            self._released[i] = True

    def materialize(self) -> None:
        """Decode every released parameter into full precision (for a forward pass)."""
        self._check_unmoved("materialize")
        self._materialize(range(len(self.params)))

    def release(self) -> None:
        """Free every parameter's full-precision storage; the packed FP4 copy remains."""
        self._release(range(len(self.params)))

    def attach(self, module: torch.nn.Module) -> torch.nn.Module:
        """Hook ``module`` (returned) so that it works with the weights stored in FP4:

        - before each forward, every released parameter is decoded (``materialize``);
        - ``module.state_dict()`` holds the decoded weights of the parameters it owns, as
          ordinary tensors of their shapes and dtypes (a plain copy of the model loads them);
          parameters that were released are released again afterwards, unless
          ``keep_vars=True`` returned the parameters themselves;
        - ``module.load_state_dict(...)`` stores the loaded weights in FP4 with this
          optimizer's rounding (as construction does; error feedback's residual of a changed
          parameter restarts from zero).  Weights equal to the ones stored now, bit for bit,
          keep their packed form, so loading a model checkpoint next to
          ``FP4StoredWeights.load_state_dict`` resumes exactly, in either order.
          ``assign=True`` would replace the stored parameters and is refused.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        held = {id(p) for p in module.parameters()}
        owned = [i for i, p in enumerate(self.params) if id(p) in held]
        saving = []  # per state_dict() call: (released indices, keep_vars)

        def before_save(module, prefix, keep_vars):
            released = [i for i in owned if self._released[i]]
            self._materialize(released)
            saving.append((released, keep_vars))

        def after_save(module, state_dict, prefix, local_metadata):
            released, keep_vars = saving.pop()
            if not keep_vars:  # the state dict holds detached tensors of its own
                self._release(released)

        def before_load(module, state_dict, prefix, local_metadata, *args):
            if local_metadata.get("assign_to_params_buffers", False):
                raise ValueError(
                    "load_state_dict(assign=True) would replace the parameters that "
                    "FP4StoredWeights stores and its optimizer updates; load without assign"
                )
            self._materialize(owned)

        def after_load(module, incompatible_keys):
            self._store_loaded(owned)

        self._hooks += [
            module.register_forward_pre_hook(lambda *_: self.materialize()),
            module.register_state_dict_pre_hook(before_save),
            _state_dict_post_hook(module, after_save),
            _load_state_dict_pre_hook(module, before_load),
            module.register_load_state_dict_post_hook(after_load),
        ]
        return module

    @torch.no_grad()
    def _store_loaded(self, indices):
        """Store parameters ``indices`` (full precision, just loaded) in FP4 again."""
        for i in indices:
            w = self.params[i].detach()
            if torch.equal(w, self._decoded(i)):
                continue  # unchanged: keep the packed form and the residual
            if self._error_feedback is not None:
                self._error_feedback.reset(self._name(i))
            self.packed[i] = self._store(i, w)
        if self.release_after_step:
            self._release(indices)
        else:
            self._materialize(indices, force=True)

    # -- optimizer interface -----------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def _check_params(self, what):
        """ValueError unless the wrapped optimizer still holds the parameters stored here (a
        parameter group added since would be updated in full precision and never stored)."""
        held = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(held) != len(self.params) or any(
            a is not b for a, b in zip(held, self.params, strict=True)
        ):
            raise ValueError(
                f"{what}: the wrapped optimizer's parameters changed since FP4StoredWeights was "
                f"made ({len(self.params)} then, {len(held)} now: add_param_group?); it stores "
                "the parameters it was made with: add every group first, then wrap the optimizer"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of the wrapped optimizer in full precision, then store it in FP4."""
        self._check_params("step")
        self._check_unmoved("step")
        self._materialize(range(len(self.params)))
        if closure is not None:
            with torch.enable_grad():
                loss = self.optimizer.step(closure)
        else:
            loss = self.optimizer.step()
        self.step_count += 1
        for i, p in enumerate(self.params):
            self._store_update(i, p.detach())
        if self.release_after_step:
            self.release()
        else:
            self._decode_all()
        return loss

    def _store_update(self, i, w):
        """Store parameter i after the optimizer's update (``w``): unchanged, it keeps its
        packed form and residual; a changed bfloat16 / float16 one is stored as its FP4 value
        plus the update, in float32 (the module docstring says why)."""
        before32 = _decode(self.packed[i], self.shapes[i])
        before = before32.to(self.dtypes[i])
        if torch.equal(w, before):
            return
        if self.dtypes[i] in (torch.bfloat16, torch.float16):
            # (both exact in float32, so the difference is the update as the optimizer made it)
            w = before32 + (w.float() - before.float())
        self.packed[i] = self._store(i, w)

    # -- memory and checkpoints ---------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
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

    def state_dict(self) -> dict[str, Any]:
        """The packed weights, error feedback's residuals and the wrapped optimizer's state
        (and its class name, which ``load_state_dict`` compares)."""
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
            "optimizer_class": type(self.optimizer).__name__,
        }

    def _load_optimizer_state(self, saved, saved_class):
        """The wrapped optimizer's ``load_state_dict(saved)``, refused (ValueError, the
        optimizer unchanged) for the state of another kind of optimizer (its parameter groups
        would lack the hyperparameters that this one's step() reads) and, for torch's own
        optimizers, for momenta or moments not of their parameters' shapes."""
        opt = self.optimizer
        here = type(opt).__name__
        if saved_class is not None and saved_class != here:
            raise ValueError(
                f"state['optimizer'] was saved by an optimizer of class {saved_class}, but this "
                f"FP4StoredWeights wraps one of class {here}: wrap the same kind to resume"
            )
        if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
            raise ValueError(
                "state['optimizer']: expected the dict that torch.optim.Optimizer.state_dict() "
                f"returns, got {type(saved).__name__}"
            )
        before = opt.state_dict()
        # the hyperparameters its groups hold now (torch's load adds 'differentiable' to the
        # defaults of an optimizer whose groups never held it, as Adafactor's)
        needed = [k for k in opt.defaults if all(k in g for g in opt.param_groups)]
        try:
            opt.load_state_dict(saved)
        except Exception:
            opt.load_state_dict(before)  # whatever torch had replaced before it raised
            raise
        # torch's load keeps the saved groups' hyperparameters (filling only those its
        # version added), so a group of another optimizer would fail at the next step()
        missing = sorted({k for g in opt.param_groups for k in needed if k not in g})
        if missing:
            opt.load_state_dict(before)
            raise ValueError(
                f"state['optimizer'] has parameter groups without {', '.join(map(repr, missing))}, "
                f"which {here}.step() needs: it is the state of another kind of optimizer "
                "(its groups have "
                f"{', '.join(map(repr, sorted(set().union(*saved['param_groups']) - {'params'})))})"
                "; wrap the same kind of optimizer to resume"
            )
        wrong = self._misshapen_optimizer_state()
        if wrong:
            opt.load_state_dict(before)
            i, name, shape = wrong
            raise ValueError(
                f"state['optimizer']: parameter {i} has shape {self.shapes[i]} but its {name} "
                f"{shape} in the state, which {here}.step() could not use: it is the optimizer "
                "state of another model"
            )

    def _misshapen_optimizer_state(self):
        """(parameter index, state name, shape) of the first moment or momentum in the wrapped
        optimizer's state that is not of its parameter's shape, or None.  Only for torch's own
        optimizers, which keep ``_PARAMETER_SHAPED_STATE`` in the parameter's shape; others may
        keep a state of that name in another shape (a factored or projected moment)."""
        if type(self.optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
            return None
        index = {id(p): i for i, p in enumerate(self.params)}
        for p, s in self.optimizer.state.items():
            i = index.get(id(p))
            if i is None:
                continue
            for name in _PARAMETER_SHAPED_STATE:
                v = s.get(name)
                if isinstance(v, torch.Tensor) and tuple(v.shape) != self.shapes[i]:
                    return i, name, tuple(v.shape)
        return None

    def _checked_packed(self, i, s):
        """The QuantizedTensor of parameter ``i`` from its fields ``s`` in a state (checked,
        moved to the parameter's device)."""
        padded = self._padded_shape(i)
        if not isinstance(s["shape"], (tuple, list, torch.Size)) or tuple(s["shape"]) != padded:
            raise ValueError(
                f"state['packed'][{i}]: shape {s['shape']!r}, expected {padded} for a "
                f"parameter of shape {self.shapes[i]}"
            )
        fields = [s.get(k) for k in ("data", "scales", "global_scale")]
        if not all(isinstance(t, torch.Tensor) and not t.is_meta for t in fields):
            raise TypeError(
                f"state['packed'][{i}]: data, scales and global_scale must be torch tensors "
                "holding values (not on the meta device)"
            )
        device = self.params[i].device
        data, scales, global_scale = (t.to(device) for t in fields)
        q = fp4_kernels.QuantizedTensor(
            data=data,
            scales=scales,
            global_scale=global_scale,
            fmt=self.fmt,
            shape=padded,
            dtype="float32",
            scale_layout="linear",
        )
        fp4_kernels.dequantize(q)  # validates every field it reads (dtype, shape, device)
        return q

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; ValueError / TypeError if it belongs to parameters of
        other shapes, to another rounding or format, to another kind of optimizer (SGD's state
        into an AdamW), holds momenta or moments of other shapes than the parameters' (checked
        for torch.optim's optimizers: SGD, Adam, AdamW, ...; an optimizer of another library
        may keep them in shapes of its own), has a step count that is not an int >= 0, or is
        not an ``FP4StoredWeights.state_dict()``.  Everything is checked before anything is
        replaced: after an error this object is as it was."""
        keys = ("rounding", "fmt", "seed", "step_count", "shapes", "packed", "optimizer")
        check_state_keys(state, keys, "FP4StoredWeights")
        shapes = _checked_shapes(state["shapes"])
        if not isinstance(state["packed"], (list, tuple)) or not all(
            isinstance(s, dict) and "shape" in s for s in state["packed"]
        ):
            raise TypeError(
                "state['packed']: expected a list of the packed parameters' fields (dicts with "
                "'shape', 'data', 'scales', 'global_scale'), as state_dict() holds them"
            )
        if len(shapes) != len(self.shapes) or len(state["packed"]) != len(self.shapes):
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
        packed = [self._checked_packed(i, s) for i, s in enumerate(state["packed"])]
        seed = check_seed(state["seed"], "state['seed']")
        step_count = check_integer(state["step_count"], "state['step_count']")
        if step_count < 0:
            raise ValueError(f"state['step_count']: {step_count} is negative")
        residuals = None
        if self._error_feedback is not None:
            if state.get("error_feedback") is None:
                raise ValueError("state: no 'error_feedback' entry for rounding='error_feedback'")
            residuals = self._error_feedback._checked_state(
                state["error_feedback"], "state['error_feedback']"
            )
            self._check_residuals(residuals[1])
        # Everything is checked; the optimizer's state is the last part that can fail, and a
        # failed load leaves it as it was.  Nothing after it raises: no half-loaded object.
        self._load_optimizer_state(state["optimizer"], state.get("optimizer_class"))
        if residuals is not None:
            self._error_feedback._assign(residuals)
        self.seed, self.step_count = seed, step_count
        self.packed[:] = packed  # (in place: the finalizer holds the list)
        self._decode_all()
        if self.release_after_step:
            self.release()


_RELEASED_MESSAGE = (
    "a parameter that FP4StoredWeights released was used: between steps it is stored only in "
    "packed FP4 and its full-precision storage is freed (an empty tensor). Call "
    "FP4StoredWeights.attach(model) once, so that every forward decodes the weights first, or "
    "materialize() before using them; update them with FP4StoredWeights.step(), not the "
    "wrapped optimizer's own step()"
)


def _released_torch_function(cls, func, types, args=(), kwargs=None):
    """Run ``func`` as on a plain parameter; an error it raises gets the reason in front (a
    released parameter is an empty tensor, whose shape errors would not say why)."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return func(*args, **(kwargs or {}))
        except (RuntimeError, IndexError, ValueError) as err:
            raise type(err)(f"{_RELEASED_MESSAGE}. {type(err).__name__}: {err}") from err


class _ReleasedParameter(torch.nn.Parameter):
    """The class of a released ``torch.nn.Parameter`` (``FP4StoredWeights.release``), swapped
    back on ``materialize``, as torch's lazy modules swap ``UninitializedParameter``: an
    operation on it that fails (a forward through an unattached model) says what is missing.
    Everything else behaves as on the parameter itself, results are plain tensors."""

    __torch_function__ = classmethod(_released_torch_function)

    def __repr__(self) -> str:
        return "Parameter released by FP4StoredWeights (stored in packed FP4; materialize())"


class _ReleasedTensor(torch.Tensor):
    """``_ReleasedParameter`` for an optimizer parameter that is a plain leaf tensor."""

    __torch_function__ = classmethod(_released_torch_function)

    def __repr__(self) -> str:
        return "tensor released by FP4StoredWeights (stored in packed FP4; materialize())"


_RELEASED_CLASS = {torch.nn.Parameter: _ReleasedParameter, torch.Tensor: _ReleasedTensor}
# optimizer -> the FP4StoredWeights that wraps it (weakly: a wrapper dropped frees its optimizer
# for another)
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAIN_CLASS = {v: k for k, v in _RELEASED_CLASS.items()}


def _mark_released(p, released):
    """Swap ``p``'s class to its released form (``released``) or back.  Parameters of other
    classes (subclasses of the user's) keep theirs."""
    table = _RELEASED_CLASS if released else _PLAIN_CLASS
    cls = table.get(type(p))
    if cls is not None:
        p.__class__ = cls


def _state_dict_post_hook(module, hook):
    """``module.register_state_dict_post_hook``, or on torch versions before it was public the
    private registration with the same hook signature."""
    register = getattr(module, "register_state_dict_post_hook", None)
    if register is None:  # pragma: no cover - older torch
        return module._register_state_dict_hook(hook)
    return register(hook)


def _load_state_dict_pre_hook(module, hook):
    """``module.register_load_state_dict_pre_hook``, or its private form on older torch."""
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is None:  # pragma: no cover - older torch
        return module._register_load_state_dict_pre_hook(hook, with_module=True)
    return register(hook)


def _checked_shapes(shapes: Any) -> list[tuple[int, ...]]:
    """``state['shapes']``: a list of shapes (sequences of ints >= 0), as tuples; TypeError
    otherwise."""
    ok = isinstance(shapes, (list, tuple)) and all(
        isinstance(s, (list, tuple, torch.Size))
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
        for s in shapes
    )
    if not ok:
        raise TypeError(
            "state['shapes']: expected a list of the parameters' shapes (tuples of ints), as "
            "state_dict() holds them"
        )
    return [tuple(s) for s in shapes]


def _decode(q, shape):
    """The float32 tensor of ``shape`` stored as ``q`` (flattened, padded to whole blocks)."""
    flat = fp4_kernels.dequantize(q, dtype=torch.float32)
    n = _numel(shape)
    # a tensor of its own (not a view of the padded buffer), so a checkpoint of it holds
    # exactly the parameter's elements
    w = flat[:n] if n == flat.numel() else flat[:n].clone()
    return w.view(shape)


def _materialize(params, packed, released, shapes, dtypes, indices, force=False):
    """Decode parameters ``indices`` that are released (all of them with ``force``) into full
    precision.  Also a dropped wrapper's finalizer, over every parameter: they stay usable
    (and can be wrapped again); it holds the wrapper's lists, not the wrapper."""
    for i in indices:
        if force or released[i]:
            p = params[i]
            if released[i]:
                _mark_released(p, False)
            released[i] = False
            p.data = _decode(packed[i], shapes[i]).to(dtypes[i])


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
