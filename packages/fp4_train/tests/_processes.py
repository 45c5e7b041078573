"""Shared harness of the multi-process fp4_train tests (importable as ``_processes``): ranks
as spawned processes that hand their results back through a pipe, and the text they train on."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def set_rank_environment(rank: int, world: int, port: int) -> None:
    """The environment ``torch.distributed.init_process_group`` reads, for rank ``rank`` of
    ``world`` on this host (LOCAL_RANK = RANK), with the rendezvous store at ``port`` hosted
    by the parent, as torchrun's agent hosts it (every rank connects as a client)."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_PORT": port}
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", **agent)


def write_corpus(path: Path) -> Path:
    """The repository's own Markdown (docs/*.md, the packages' READMEs) at ``path``: real
    English text that is always there, so CI needs no Debian package."""
    texts = sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("packages/*/README.md"))
    path.write_text("\n\n".join(p.read_text() for p in texts))
    return path


def spawn(world: int, target, *args, minutes: float = 10) -> list:
    """``target(rank, *args)`` (a module-level function) in ``world`` spawned processes, each
    with the environment of its rank (``set_rank_environment``); their return values, by
    rank.  RuntimeError with the traceback of the first rank that raised, TimeoutError where
    one has not finished within ``minutes``.  The processes are joined (killed after 10 s) in
    any case."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    # The parent hosts the rendezvous on a port the system picks and holds it bound from the
    # start: test processes running side by side (pytest-xdist) never pick the same one.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    conns, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, args=(target, rank, world, port, args, child))
        p.start()
        child.close()  # the rank's end only: a rank that dies is seen at once (EOF)
        conns.append(parent)
        procs.append(p)
    try:
        results = []
        for c in conns:
            if not c.poll(datetime.timedelta(minutes=minutes).total_seconds()):
                raise TimeoutError(f"a test worker did not finish in {minutes} minutes")
            try:
                status, value = c.recv()
            except EOFError:  # the process ended without an answer (killed, or a crash)
                raise RuntimeError("a test worker died without an answer") from None
            if status != "ok":
                raise RuntimeError(value)
            results.append(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _rank_main(target, rank, world, port, args, conn):
    # a spawned rank: its result, or the traceback of what it raised, back through the pipe
    try:
        set_rank_environment(rank, world, port)
        conn.send(("ok", target(rank, *args)))
    except BaseException:  # noqa: BLE001 - handed to the test, which fails with it
        conn.send(("error", traceback.format_exc()))
