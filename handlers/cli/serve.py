"""`warmstart serve REF`: listen at once, load the snapshot in a thread, serve the OpenAI API, drain on SIGTERM.

Before the socket is bound only what answering HTTP needs is imported (Starlette, uvicorn,
prometheus-client, these handlers); torch and the snapshot loader are imported by the loading thread
afterwards, so /health answers 503 while they load. stdout carries one JSON line per cold-start phase
(see handlers.server.timeline): scripts wait for `"phase": "listening"` (it has the URL and port) and
`"phase": "ready"`. On SIGTERM the server stops accepting, lets in-flight requests finish for up to
--grace-seconds, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from warmstart.handlers.cli import vllm_flags
from warmstart.handlers.errors import CliError, device_name, fraction, non_negative_int, port_number, positive_int
from warmstart.handlers.openai.reasoning import PARSERS as REASONING_PARSERS
from warmstart.handlers.openai.tool_calls import PARSERS as TOOL_CALL_PARSERS
from warmstart.handlers.server import kv_tier_options
from warmstart.handlers.server.timeline import cold_start_timeline, print_json_line
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.timeline import Timeline


def add_command(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a snapshot over an OpenAI-compatible HTTP API")
    serve.add_argument("ref", nargs="?", help="snapshot id, unique id prefix or ref name (or --model REF); or an HF "
                       "model directory, GGUF file or hub id (ORG/NAME), built into the store first (for a fast cold "
                       "start, build it once with `warmstart build MODEL --tag NAME` and serve NAME)")
    serve.add_argument("--revision", help="a hub id's branch, tag or commit (default main)")
    serve.add_argument("--store", help="a directory, file://PATH or s3://BUCKET/PREFIX (default $WARMSTART_STORE)")
    serve.add_argument("--cache", type=Path, help="local blob cache (default $WARMSTART_CACHE)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port to listen on; 0 picks a free one")
    serve.add_argument("--served-model-name", help="the model name clients send (default: REF)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                       help="split a reasoning model's <think>...</think> into reasoning_content (as vLLM's parsers)")
    serve.add_argument("--embedding-pooling", choices=("last", "mean"), default="last",
                       help="how /v1/embeddings pools a prompt's final hidden states into one (L2-normalized) vector: "
                            "its last token's, as vLLM pools decoder models, or the mean over its tokens (default "
                            "last)")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                       help="the format tool calls are read from in chat replies (default: the one the chat "
                            "template shows: <tool_call> hermes, [TOOL_CALLS] mistral, <|python_tag|> llama3_json)")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--device", type=device_name, default="auto",
                        help="where the engine runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or "
                             "cuda:N; a GPU runs the Triton kernels and CUDA graphs (default auto)")
    engine.add_argument("--gpu-memory-utilization", type=fraction,
                        help="on a GPU: the fraction of its memory this server may use, weights, activations and KV "
                             f"pool together, as in vLLM (default {EngineOptions.gpu_memory_utilization:g})")
    engine.add_argument("--max-num-seqs", type=positive_int,
                        help=f"requests run at once (default {EngineOptions.max_num_seqs})")
    engine.add_argument("--max-num-batched-tokens", type=positive_int,
                        help=f"tokens per step (default {EngineOptions.max_num_batched_tokens})")
    engine.add_argument("--num-kv-blocks", type=positive_int, help="KV pool size (default: from free memory)")
    engine.add_argument("--max-model-len", type=positive_int, help="context length (default: the model's)")
    engine.add_argument("--speculative", choices=("ngram", "draft"),
                        help="speculative decoding: ngram (prompt lookup) or draft (the snapshot's draft model, "
                             "built with --draft); default off")
    engine.add_argument("--num-speculative-tokens", type=positive_int,
                        help=f"tokens proposed and verified per step and sequence "
                             f"(default {EngineOptions.num_speculative_tokens})")
    engine.add_argument("--max-loras", type=positive_int,
                        help="LoRA adapters resident at once; others are paged in when a request needs one, least "
                             f"recently used out (default {EngineOptions.max_loras})")
    engine.add_argument("--max-lora-rank", type=positive_int,
                        help="the largest LoRA rank served; an adapter of a higher rank is refused "
                             f"(default {EngineOptions.max_lora_rank})")
    engine.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="ranks the model is split across (the snapshot must be built for N); on one machine "
                             "this process is rank 0 and starts the others; under torchrun, one per process")
    engine.add_argument("--collective-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="with --tensor-parallel: how long a rank waits on the others in a step (default 60)")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-queue", type=non_negative_int, default=256,
                        help="requests that may wait beyond --max-num-seqs before a 429 (default 256)")
    limits.add_argument("--max-body-bytes", type=positive_int, default=2 << 20,
                        help="largest request body accepted (default 2 MiB)")
    limits.add_argument("--max-header-bytes", type=positive_int, default=MAX_HEAD_BYTES,
                        help="largest request line and headers, together; past it a 431 and the connection closed "
                             f"(default {MAX_HEAD_BYTES // 1024} KiB)")
    limits.add_argument("--max-connections", type=positive_int, default=MAX_CONNECTIONS,
                        help="open connections at most; one more gets a 503 and is closed before it is read "
                             f"(default {MAX_CONNECTIONS})")
    limits.add_argument("--grace-seconds", type=float, default=30.0,
                        help="on SIGTERM, how long in-flight requests may take to finish; those still running then "
                             "end with an error (a 503, or an SSE error event) (default 30)")
    limits.add_argument("--body-timeout-seconds", type=float, default=30.0,
                        help="a request body not all received within this is answered 408 (default 30)")
    limits.add_argument("--keep-alive-seconds", type=float, default=KEEP_ALIVE_SECONDS,
                        help="how long an idle keep-alive connection stays open; keep it above the idle timeout of "
                             f"a load balancer in front (default {KEEP_ALIVE_SECONDS:g}, above AWS ALB's 60)")
    auth = limits.add_mutually_exclusive_group()
    auth.add_argument("--api-key", metavar="KEY",
                      help="the API key, as vLLM's --api-key: every route but /health needs 'Authorization: Bearer "
                           "KEY' (a process listing shows it; --api-key-env keeps it out of one)")
    auth.add_argument("--api-key-env", metavar="NAME",
                      help="environment variable holding the API key (it must be set and not empty); without "
                           f"either option the key is ${DEFAULT_KEY_ENV} where that is set, else no key is needed")
    kv_tier_options.add_arguments(serve)
    http = serve.add_argument_group("http")
    http.add_argument("--allowed-origins", type=origin_list, default=(), metavar="ORIGINS",
                      help="browser origins allowed to call the API, comma-separated ('*' for any): answers CORS "
                           "preflights (before the API key is checked) and adds CORS headers (default: no CORS)")
    http.add_argument("--sse-ping-seconds", type=float, default=15.0, metavar="SECONDS",
                      help="a stream with nothing to send for this long gets a ': ping' SSE comment, which keeps "
                           "proxies from closing it (default 15)")
    http.add_argument("--no-access-log", dest="access_log", action="store_false",
                      help="leave out the JSON line per request (method, path, status, duration, request id, token "
                           "counts; never the prompt) that stdout has by default")
    http.add_argument("--special-tokens-in-content", action="store_true",
                      help="let special-token text in a chat request's messages, tools and documents become control "
                           "tokens, as transformers' apply_chat_template does; by default it stays text, so that a "
                           "message cannot open a turn of another role (runtime/chat_content.py)")
    http.add_argument("--tenant-header", metavar="NAME",
                      help="a request header naming the tenant (required on every generation request): each tenant's "
                           "prompts are cached in a chain of their own, as with a cache_salt per tenant, so no tenant "
                           "sees another's cache hits (nor reuses the snapshot's prefixes: each tenant computes them "
                           "once). By default every request may reuse every other's cached prompt")
    vllm_flags.add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)


# Before a request is known (handlers/server/http_limits.py): 64 KiB of request line and headers, of the order of
# nginx's large_client_header_buffers (4 x 8 KiB); connections a few times what --max-num-seqs and --max-queue hold.
MAX_HEAD_BYTES = 64 * 1024
MAX_CONNECTIONS = 1024
KEEP_ALIVE_SECONDS = 75.0  # nginx's default; a balancer reusing a connection the server just closed gets a 502
CUT_MARGIN_SECONDS = 5.0  # after the grace period, for requests ended with an error to say so and close
# After that, the KV tier's queued writes (state.shutdown: 5 s at most) and a last margin: then the process exits,
# whatever its threads are doing (a KV tier read stuck on an unreachable S3).
EXIT_MARGIN_SECONDS = 5.0 + 2.0
EXIT_LINGER_SECONDS = 2.0  # once a failed load's error is printed, threads left in I/O are not waited for longer


def origin_list(value: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    bad = [o for o in origins if o != "*" and not o.startswith(("http://", "https://"))]
    if not origins or bad:
        raise argparse.ArgumentTypeError(f"{(bad or [value])[0]!r} is not an origin; give origins such as "
                                         "https://app.example.com (comma-separated), or '*' for any")
    return origins


DEFAULT_KEY_ENV = "WARMSTART_API_KEY"


def api_key(args: argparse.Namespace) -> str | None:
    """The key every request must bear, or None; an auth option that resolves to no key refuses to start."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise CliError("--api-key is empty: give the key, or leave the option out to serve without one")
        return str(args.api_key)
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env, "")
        if not key.strip():
            raise CliError(f"--api-key-env {args.api_key_env}: that environment variable is "
                           f"{'empty' if args.api_key_env in os.environ else 'not set'}; set it to the key, or "
                           "leave the option out to serve without one")
        return key
    return os.environ.get(DEFAULT_KEY_ENV) or None


def cmd_serve(args: argparse.Namespace) -> int:
    from warmstart.handlers.cli.tensor_parallel import end_followers, plan_ranks, run_follower, start_followers, watch

    vllm_flags.snapshot_ref(args)
    timeline = cold_start_timeline(print_json_line)
    for flag, value in (("--grace-seconds", args.grace_seconds), ("--keep-alive-seconds", args.keep_alive_seconds)):
        if not value >= 0:  # NaN too
            raise CliError(f"{flag} must be a number of seconds >= 0, got {value}")
    if not args.sse_ping_seconds > 0:
        raise CliError(f"--sse-ping-seconds must be a number of seconds > 0, got {args.sse_ping_seconds}")
    if not args.body_timeout_seconds > 0:
        raise CliError(f"--body-timeout-seconds must be a number of seconds > 0, got {args.body_timeout_seconds}")
    if args.collective_timeout <= 0:
        raise CliError(f"--collective-timeout must be > 0, got {args.collective_timeout}")
    engine_options = {name: getattr(args, name) for name in
                      ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len", "speculative",
                       "num_speculative_tokens", "gpu_memory_utilization", "max_loras", "max_lora_rank")
                      if getattr(args, name) is not None}
    if args.tensor_parallel > 1 and args.speculative:
        raise CliError("--speculative does not combine with --tensor-parallel yet; leave one of them out")
    key = api_key(args)
    kv_tier = kv_tier_options.config_from(args)
    model = model_to_serve(args.ref)
    if model is not None and args.tensor_parallel > 1:
        raise CliError(f"{args.ref} is a model, not a snapshot; for --tensor-parallel build it first (`warmstart build "
                       f"{args.ref} --tensor-parallel {args.tensor_parallel} --tag NAME`) and serve NAME")
    if model is None and args.revision is not None:
        raise CliError(f"--revision is for a hub id; {args.ref} is a snapshot")
    ranks = plan_ranks(args)
    if ranks.is_follower:
        return run_follower(args, engine_options)
    import uvicorn

    from warmstart.handlers.server.app import create_app
    from warmstart.handlers.server.http_limits import bounded_protocol
    from warmstart.handlers.server.state import Limits, ServeState, load_snapshot

    timeline.mark("imports")
    sock = bind(args.host, args.port)
    start_followers(ranks, args)  # on one machine: they load their shards while rank 0 starts listening
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    limits = Limits(args.max_queue, args.max_body_bytes, key,
                    args.body_timeout_seconds, args.sse_ping_seconds, args.allowed_origins, args.access_log)
    state = ServeState(args.ref, args.served_model_name or args.ref, timeline, limits, url=url,
                       reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                       special_tokens_in_content=args.special_tokens_in_content, tenant_header=args.tenant_header,
                       embedding_pooling=args.embedding_pooling)

    def load() -> None:
        if model is not None:
            try:
                state.ref = build_to_serve(model, args.revision, args.store, args.cache, timeline)
            except CliError as e:
                state.fail(str(e))
        if state.status != "failed":
            load_snapshot(state, args.store, args.cache, engine_options, ranks.world, args.collective_timeout,
                          device=args.device, kv_tier=kv_tier)
        if state.status == "failed":
            print_json_line({"event": "error", "message": state.error})
            server.should_exit = True

    def on_listening() -> None:
        timeline.mark("listening", url=url, host=host, port=port, pid=os.getpid())
        threading.Thread(target=load, name="warmstart-load", daemon=True).start()

    async def cut_after_grace() -> None:
        await asyncio.sleep(args.grace_seconds)
        if state.service is not None:
            print_json_line({"event": "grace_period_over", "requests_cut": state.service.in_flight})
            await state.service.cut_in_flight()

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                on_listening()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn's own timeout cancels what still runs (a cut stream, a 500 and a traceback): end those
            # requests first with an error that says why, and keep its timeout as the last resort.
            cut = asyncio.ensure_future(cut_after_grace())
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    # ws="none": no WebSocket routes, so uvicorn need not import the websockets package (15-50 ms) at start.
    server = Server(uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off", ws="none",
                                   http=bounded_protocol(args.max_header_bytes, args.max_connections),
                                   timeout_keep_alive=args.keep_alive_seconds,
                                   timeout_graceful_shutdown=args.grace_seconds + CUT_MARGIN_SECONDS))

    def stop(signum: int, frame: Any) -> None:
        if not server.should_exit:
            exit_within(args.grace_seconds + CUT_MARGIN_SECONDS + EXIT_MARGIN_SECONDS, 0, "the grace period is over")
        server.should_exit = True

    def rank_lost(why: str) -> None:
        if state.status != "failed":  # a failed load already said why; the followers then fail with it
            state.fail(why)
            print_json_line({"event": "error", "message": why})
        server.should_exit = True

    if ranks.followers:
        print_json_line({"event": "tensor_parallel", "ranks": [{"rank": r, "pid": p.pid}
                                                               for r, p in enumerate(ranks.followers, start=1)]})
    if ranks.world > 1:
        watch(ranks, state.engine_failure, rank_lost, lambda: bool(server.should_exit))

    # uvicorn drains on SIGTERM, then restores this handler and raises the signal again; exiting 0 after a
    # drain (what platforms expect of a clean stop) needs a handler here that does not kill the process.
    signal.signal(signal.SIGTERM, stop)
    try:
        server.run(sockets=[sock])
    finally:
        state.shutdown()
        follower_codes = end_followers(ranks)
    if state.status == "failed":
        exit_within(EXIT_LINGER_SECONDS, 1, "the load failed")
        raise CliError(state.error or "the snapshot failed to load")
    print_json_line({"event": "stopped", "seconds": round(timeline.elapsed(), 4),
                     **({"follower_exit_codes": follower_codes} if follower_codes else {})})
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """End a stopped server's process with ``code`` at once: every request is done and what must be kept is
    written (state.shutdown flushed the KV tier's queue). The interpreter's teardown is skipped: stopped while the
    weights' background prepacking was still inside oneDNN, its C++ teardown aborted the process (SIGABRT, exit
    134) instead of exiting 0."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_within(seconds: float, code: int, why: str) -> None:
    """End the process with ``code`` after ``seconds`` if it is still running then: the interpreter's exit waits
    for every non-daemon thread, and one stuck in I/O (a KV tier read on an unreachable S3, with its own
    timeouts and retries) kept a stopped server alive for a minute past its grace period."""

    def watch() -> None:
        time.sleep(seconds)
        busy = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        print_json_line({"event": "exit_forced", "why": why, "after_seconds": seconds, "threads_left": busy})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=watch, name="warmstart-exit-watchdog", daemon=True).start()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound here rather than by uvicorn so that the port (also a free one picked for
    --port 0) is known, and a busy port is one clear error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise CliError(f"cannot listen on {host}: {e.strerror} (give an address such as 127.0.0.1)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror} (pick another --port, or --port 0 for any "
                       "free one)") from None
    return sock


def model_to_serve(ref: str) -> str | None:
    """REF when it names a model, which serve builds into the store first: an HF model directory (a config.json in
    it), a GGUF file or a hub id (ORG/NAME: no snapshot ref holds a '/'); None for a snapshot."""
    from warmstart.snapshot import hub

    path = Path(ref).expanduser()
    is_gguf = path.suffix == ".gguf" and path.is_file()
    return ref if (path / "config.json").is_file() or is_gguf or hub.is_hub_id(ref) else None


def build_to_serve(model: str, revision: str | None, store: str | None, cache: Path | None,
                   timeline: Timeline) -> str:  # fmt: skip
    """The one-step form of `serve MODEL`: a snapshot of the model directory (a hub id's in huggingface_hub's cache,
    downloaded first where needed) built with the default options and pushed to the store (a rebuild of unchanged
    inputs uploads nothing), its blobs left in the cache the load reads; returns its id. Each build line is logged
    as a JSON event; the errors a user can cause come as one CliError."""
    from warmstart.handlers.cli.snapshots import model_to_build, user_errors

    model_dir, origin = model_to_build(model, revision,
                                       lambda line: print_json_line({"event": "build", "message": line}))
    with user_errors():
        from warmstart.snapshot.build import BuildError, BuildOptions, build_snapshot
        from warmstart.snapshot.cache import BlobCache
        from warmstart.snapshot.stores import open_store
        from warmstart.snapshot.transfer import push_snapshot

        target = open_store(store)
        try:
            built = build_snapshot(model_dir, BuildOptions(), BlobCache(cache),
                                   log=lambda line: print_json_line({"event": "build", "message": line}),
                                   origin=origin)
        except BuildError as e:
            raise CliError(str(e)) from None
        push_snapshot(target, built.manifest.encode(), built.id, built.blob_paths)
    timeline.mark("build", snapshot_id=built.id, model_dir=str(model_dir), store=target.uri, source=origin)
    return built.id
