"""This tree's `warmstart serve` against another commit's, side by side in one run: did a change cost throughput?

    python -m benchmarks.serve_ab --base COMMIT [--rounds 3] [--scale 0.25] [--concurrency 32] [--json OUT]

The base commit is checked out into a temporary git worktree; where its C kernels' sources equal this tree's it
borrows this tree's built extensions, otherwise it builds its own (`setup.py build_ext --inplace`). One bf16
snapshot of the SmolLM2-135M shape (random weights) is built with this tree and served by both, each server a
fresh process per round on 127.0.0.1, replaying benchmarks/serve_load.py's `mixed` workload (streaming
completions, greedy, EOS ignored, at most --concurrency clients). Rounds alternate which tree goes first, so that
load on a shared machine hits both. Printed: per round and median, tokens/s, generated tokens/s, TTFT and
inter-token p50/p99 of each, and the ratio this / base of tokens/s per round and its median (1.00 = no change).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.cold_start import free_port
from benchmarks.serve_load import run_server
from benchmarks.throughput import model_dir as bench_model_dir
from benchmarks.workloads import REPO, SHARED_BENCH, load_workload

KERNEL_SOURCES = ["runtime/kernels", "setup.py"]


def base_tree(commit: str, where: Path) -> Path:
    """``commit`` checked out at ``where``, its C extensions in place."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(where), commit], check=True,
                   stdout=subprocess.DEVNULL)
    same = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", commit, "--", *KERNEL_SOURCES]).returncode == 0
    built = sorted((REPO / "runtime" / "kernels").glob("_cpu_*.so"))
    if same and built:
        for so in built:
            shutil.copy2(so, where / "runtime" / "kernels" / so.name)
    else:
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=where, check=True,
                       stdout=subprocess.DEVNULL)
    return where


def importable(tree: Path, links: Path) -> tuple[str, Path]:
    """The CLI's module in ``tree`` and the path that imports it from there: commits that install the folders as
    warmstart.runtime, ... (setup.py's package_dir) get a link tree warmstart/ -> the folders, older ones the tree
    itself (`handlers.cli`)."""
    if "package_dir" not in (tree / "setup.py").read_text():
        return "handlers.cli", tree
    (links / "warmstart").mkdir(parents=True, exist_ok=True)
    for folder in ("runtime", "snapshot", "handlers"):
        (links / "warmstart" / folder).symlink_to(tree / folder, target_is_directory=True)
    return "warmstart.handlers.cli", links


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. main~3)")
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--scale", type=float, default=0.25, help="fraction of the mixed workload's 128 requests")
    ap.add_argument("--concurrency", type=int, default=32)
    args = harness.parse(ap)

    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.stores import open_store
    from warmstart.snapshot.transfer import push_snapshot

    model = bench_model_dir(args.config)
    requests = load_workload("mixed", json.loads((model / "config.json").read_text())["vocab_size"], scale=args.scale)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees = {"this": REPO, "base": base_tree(args.base, tmp / "base")}
        try:
            built = build_snapshot(model, BuildOptions(dtype="bfloat16"), BlobCache(tmp / "cache"))
            push_snapshot(open_store(str(tmp / "store")), built.manifest.encode(), built.id, built.blob_paths)
            for i in range(args.rounds):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                row = {}
                for name in order:
                    port = free_port()
                    module, path = importable(trees[name], tmp / f"import-{name}")
                    cmd = [sys.executable, "-m", module, "serve", built.id, "--store", str(tmp / "store"),
                           "--cache", str(tmp / "cache"), "--port", str(port), "--max-queue", "1024"]
                    row[name] = run_server(cmd, {**env, "PYTHONPATH": str(path)}, port, requests,
                                           args.concurrency, stream=True, cwd=trees[name])
                rounds.append(row)
                print(f"round {i + 1} ({' then '.join(order)}): " + "  ".join(
                    f"{n} {row[n]['tok_s']:.0f} tok/s, TTFT p50 {row[n]['ttft_p50']:.2f} s, ITL p50 "
                    f"{row[n]['itl_p50'] * 1e3:.1f} ms, errors {row[n]['errors']}" for n in trees), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp / "base")], check=False)
    ratio = harness.ratio([r["this"]["tok_s"] for r in rounds], [r["base"]["tok_s"] for r in rounds])
    keys = ("tok_s", "gen_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
    med = {n: {k: harness.median(r[n][k] for r in rounds) for k in keys} for n in trees}
    print(f"mixed x {args.scale}: {len(requests)} requests, at most {args.concurrency} clients; {args.config.stem} "
          f"bf16; base {args.base}; medians of {args.rounds} rounds")
    print(f"{'tree':<6}{'tok/s':>8}{'gen tok/s':>10}{'TTFT p50':>9}{'p99':>7}{'ITL p50':>9}{'p99':>8}")
    for n, m in med.items():
        print(f"{n:<6}{m['tok_s']:>8.0f}{m['gen_tok_s']:>10.0f}{m['ttft_p50']:>9.2f}{m['ttft_p99']:>7.2f}"
              f"{m['itl_p50'] * 1e3:>8.1f}m{m['itl_p99'] * 1e3:>7.1f}m")
    print(f"this / base tok/s: {harness.ratio_text(ratio)}")
    harness.report(args, {"base": args.base, "rounds": rounds, "this_over_base_tok_s": ratio, "medians": med})
    if any(r[n]["errors"] for r in rounds for n in trees):
        sys.exit(1)


if __name__ == "__main__":
    main()
