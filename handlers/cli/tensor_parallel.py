"""`warmstart serve --tensor-parallel N`: the ranks of a tensor-parallel server.

On one machine, the process started by the user is rank 0 (HTTP, scheduler, sampler): it picks a rendezvous
port and starts ranks 1..N-1 as child processes of the same command, which load only their own shards and
follow rank 0's steps. Under torchrun (several machines) WORLD_SIZE and RANK are already set: every process
is one rank, and rank 0 serves HTTP. A rank that dies takes the server down: rank 0 watches its children and
its engine, marks itself failed (so /health answers 503) and exits non-zero; a follower whose rank 0 is gone
fails its next collective and exits non-zero too.

Nothing here imports torch at module level: rank 0 must listen before the runtime is imported.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from warmstart.handlers.errors import CliError

ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len", "gpu_memory_utilization",
                "device")
WATCH_INTERVAL_S = 0.2


@dataclass
class RankPlan:
    world: int
    rank: int
    local: bool = False  # rank 0 of a group on this machine, which starts the other ranks itself
    followers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # started by this process

    @property
    def is_follower(self) -> bool:
        return self.rank != 0


def plan_ranks(args: argparse.Namespace) -> RankPlan:
    """Which rank this process is; on one machine (no WORLD_SIZE yet) it is rank 0 and will start the others."""
    n = args.tensor_parallel
    if "WORLD_SIZE" in os.environ:  # torchrun, or a follower started by our own rank 0
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        if world != n:
            raise CliError(f"--tensor-parallel {n} but WORLD_SIZE={world}; give every rank --tensor-parallel {world}")
        return RankPlan(world, rank)
    return RankPlan(n, 0, local=n > 1)


def start_followers(plan: RankPlan, args: argparse.Namespace) -> None:
    """Rank 0 of a one-machine group: pick a rendezvous port and start ranks 1..N-1 as child processes."""
    if not plan.local:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(plan.world), RANK="0",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(plan.world))
    plan.followers = [
        subprocess.Popen(follower_command(args), env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.DEVNULL)
        for r in range(1, plan.world)
    ]


def follower_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", __package__, "serve", args.ref, "--tensor-parallel", str(args.tensor_parallel),
           "--collective-timeout", str(args.collective_timeout)]
    if args.store:
        cmd += ["--store", args.store]
    if args.cache:
        cmd += ["--cache", str(args.cache)]
    for name in ENGINE_FLAGS:
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return cmd


def run_follower(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """A rank > 0: load this rank's shard, report its cold start to rank 0, follow rank 0's steps."""
    rank = os.environ.get("RANK", "?")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches rank 0 too, which stops the group cleanly
    try:
        from warmstart.runtime.engine.tensor_parallel import TensorParallelGroup, follow
        from warmstart.snapshot.cache import BlobCache
        from warmstart.snapshot.loader import load_with_report

        group = TensorParallelGroup(timeout_s=args.collective_timeout, device=args.device)
        llm, report = load_with_report(args.ref, args.store, BlobCache(args.cache), group=group, device=args.device,
                                       **engine_options)
        group.gather_objects(report.rank_load(group.rank))
        follow(llm.engine.runner, group)
    except Exception as e:  # the loader's errors say what to do; a failed collective names the lost peer
        print(f"warmstart: error: tensor-parallel rank {rank}: {e}", file=sys.stderr)
        return 1
    group.close()
    return 0


def watch(plan: RankPlan, engine_failure: Callable[[], str | None], stop: Callable[[str], None],
          stopping: Callable[[], bool]) -> None:
    """Rank 0: call ``stop`` with the reason once a follower process exits or the engine (a collective) fails
    (``engine_failure`` says why, or None while it runs)."""

    def loop() -> None:
        while not stopping():
            for r, proc in enumerate(plan.followers, start=1):
                if proc.poll() is not None:
                    stop(f"tensor-parallel rank {r} exited with code {proc.returncode}; the server cannot go on "
                         "without it")
                    return
            failure = engine_failure()
            if failure is not None:
                stop(f"the engine stopped: {failure}")
                return
            time.sleep(WATCH_INTERVAL_S)

    threading.Thread(target=loop, name="warmstart-rank-watch", daemon=True).start()


def end_followers(plan: RankPlan, grace_s: float = 10.0) -> list[int]:
    """Wait for followers told to stop, killing any that do not exit in ``grace_s``; their exit codes."""
    deadline = time.monotonic() + grace_s
    for proc in plan.followers:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in plan.followers]
