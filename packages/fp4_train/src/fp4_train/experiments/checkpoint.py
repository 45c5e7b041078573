"""Checkpoints that resume a ``tp_train`` / ``emulated_tp`` run bit for bit, and when to
write them.

A checkpoint holds everything the later steps depend on (``Runner.state_dict``): the model's
weights, the optimizer's state, the learning-rate schedule's step, every communicator's call
and send counters (the default stochastic-rounding ``step`` of its collectives and pipeline
sends) and error-feedback residuals, the random number generators' states (torch's CPU and
CUDA generators, numpy's, Python's ``random``), the steps, evaluations and payload statistics
recorded so far, and the arguments of the run (a resumed run must be given the same ones).
The batches need no position: ``corpus.train_batch`` draws a step's batch from the seed and
the step alone, so the next step number is the loader's position.

Each process writes its own shard (``shard_path``), atomically: to a temporary file in the
same folder, flushed to disk, then renamed over the old one, so a process killed while
writing leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .records import plain

#: The exit status of a run that stopped at its limit and wrote a checkpoint: resumable, not
#: finished (sysexits.h's EX_TEMPFAIL).
EX_TEMPFAIL = 75
FORMAT = 1
#: ``tp_train`` arguments that do not change a run's bits: a resumed run may give others.
RUNTIME_ARGS = frozenset({"checkpoint", "checkpoint_every_s", "stop_at_step", "stop_at_s",
                          "quiet", "out", "name", "check_finite", "graph_cache_gb"})  # fmt: skip


def shard_path(path, rank: int, world_size: int) -> Path:
    """The file rank ``rank`` of ``world_size`` processes reads and writes: ``path`` itself
    if it ends in ``.pt`` and the run has one process (``<stem>.rank<r>.pt`` beside it with
    several); otherwise ``path`` is a folder holding ``rank<r>.pt``."""
    path = Path(path)
    if path.suffix == ".pt":
        return path if world_size == 1 else path.with_name(f"{path.stem}.rank{rank}.pt")
    return path / f"rank{rank}.pt"


def save(path: Path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; a failed write's partial file


def load(path: Path) -> dict:
    """A checkpoint ``save`` wrote, its tensors on the CPU (``torch.load``'s safe loader:
    tensors and plain Python values only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read(path: Path) -> tuple[dict | None, str | None]:
    """(``load(path)``, None), or (None, why) where ``path`` is not a checkpoint ``save``
    wrote (truncated, corrupt, another kind of file)."""
    try:
        state = load(path)
    except Exception as e:  # torch.load's errors: RuntimeError, UnpicklingError, EOFError...
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    if not isinstance(state, dict) or not {"format", "records", "runner"} <= state.keys():
        return None, "not a checkpoint of this program"
    return state, None


def progress(path, world_size: int = 1) -> tuple[int, int] | None:
    """(steps done, steps of the run) of the checkpoint at ``path`` (the ``--checkpoint`` of a
    run of ``world_size`` processes: rank 0's shard), read through a memory map, without the
    tensors' data; None where there is none or it is not a readable checkpoint."""
    shard = shard_path(path, 0, world_size)
    if not shard.is_file():
        return None
    try:
        state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
        return len(state["records"]["steps"]), int(state["config"]["steps"])
    except Exception:  # torch.load's errors (as in ``read``), or a state without those keys
        return None


def config_of(args) -> dict:
    """The arguments that fix a run's bits (every one but ``RUNTIME_ARGS``), as plain values."""
    return {k: plain(v) for k, v in sorted(vars(args).items()) if k not in RUNTIME_ARGS}


def check_config(saved: dict, args, path, options=None) -> None:
    """ValueError naming the arguments in which this run differs from the checkpoint's.
    ``options``: the caller's own arguments that fix the run's bits, beside ``args``
    (``emulated_tp``'s ``--tp``), compared where the checkpoint records them (an older one
    may not)."""
    options = {k: v for k, v in (options or {}).items() if k in saved}
    mine = {**config_of(args), **options}
    differ = [f"--{k.replace('_', '-')} {saved.get(k)!r} there, {mine.get(k)!r} here"
              for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]  # fmt: skip
    if differ:
        raise ValueError(f"checkpoint {path} belongs to a run with other arguments ("
                         + "; ".join(differ) + "): resume it with the arguments it was "
                         "started with, or give this run another --checkpoint")  # fmt: skip


def to_device(obj, device):
    """``obj`` (nested dicts and lists of tensors and plain values) with every tensor on
    ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    return obj


# ------------------------------------------------------------------ random number generators


def rng_state(device: torch.device) -> dict:
    """The states of torch's CPU generator, ``device``'s CUDA generator (None on the CPU),
    numpy's global generator and Python's ``random``, as values ``load`` reads back."""
    # the legacy global generator is the state to keep: code that calls np.random.* uses it
    name, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore ``rng_state``'s states."""
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))  # noqa: NPY002
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# ------------------------------------------------------------------ when to write, when to stop


class Schedule:
    """When a run writes its checkpoint and when it stops (``--checkpoint-every-s``,
    ``--stop-at-step``, ``--stop-at-s``), decided after each step.  The clock starts at
    construction.  With several processes (``group``: their gloo control group, set before
    the first step) rank 0's clock
    decides and the others follow it (a broadcast after each step, only where a time limit
    is set), so that every rank writes and stops after the same step."""

    def __init__(self, args, group=None) -> None:
        self.every_s = args.checkpoint_every_s or None
        self.stop_at_step, self.stop_at_s = args.stop_at_step, args.stop_at_s
        self.group = group
        self.start = self.last = time.monotonic()

    def after(self, steps_done: int) -> tuple[bool, bool]:
        """(write a checkpoint, stop) after ``steps_done`` steps of the run."""
        now = time.monotonic()
        stop = self.stop_at_s is not None and now - self.start >= self.stop_at_s
        save = self.every_s is not None and now - self.last >= self.every_s
        if self.group is not None and (self.every_s or self.stop_at_s is not None):
            flags = torch.tensor([save, stop], dtype=torch.int32)
            dist.broadcast(flags, group_src=0, group=self.group)
            save, stop = bool(flags[0]), bool(flags[1])
        stop = stop or steps_done == self.stop_at_step
        if save or stop:
            self.last = now
        return save or stop, stop
