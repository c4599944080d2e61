"""`warmstart demo` (what `make demo` runs): the whole job on the local default store, end to end.

It prepares SmolLM2-135M-Instruct (once; a random model of its shape when that cannot be fetched), snapshots
it with a long system prompt into the local store (again only when something changed), starts `warmstart serve`
on it as a fresh process, sends a chat request that hits the snapshot's prefix and a streaming one, prints the
cold-start timeline and a curl line, and keeps serving until Ctrl-C (or exits after the requests with --json /
--no-wait).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from warmstart.handlers.errors import CliError, port_number, positive_int

DEMO_CONFIG = "smollm2-135m.json"
DEMO_REF = "demo"
PREFIX_NAME = "assistant"
READY_TIMEOUT_S = 600.0
USER_QUESTION = "Which of the shop's rules matter most when a parcel arrives damaged?"

# Long on purpose: this is what the snapshot precomputes, so that requests behind it start at once.
DEMO_SYSTEM_PROMPT = "\n\n".join([
    "You are the assistant of Hartley & Finch, an independent bookshop and bindery founded in 1911. You answer "
    "customers' questions by e-mail and chat. Follow the handbook below exactly. When the handbook does not cover "
    "a question, say so plainly and offer to pass the question to a member of staff.",
    *(f"Rule {i + 1}. {rule}" for i, rule in enumerate([
        "Greet the customer by name when you know it, and never more than once per conversation.",
        "Opening hours are nine to six from Monday to Saturday, and eleven to four on Sunday. The shop is closed "
        "on public holidays, except for the Saturday before Christmas, when it stays open until eight.",
        "Orders placed before two in the afternoon leave the same day. Standard delivery takes two to four working "
        "days within the country and seven to fourteen days abroad. Tracked delivery costs four pounds extra.",
        "A parcel that arrives damaged is replaced at no cost. Ask for a photograph of the parcel and of the book, "
        "the order number and the delivery address, and promise a reply within one working day.",
        "Returns are accepted within thirty days for books in the condition in which they were sold. Signed, "
        "rebound and special-order books cannot be returned unless they are faulty.",
        "Refunds go back to the card that paid, within five working days of the return reaching the shop.",
        "The bindery restores old books: rebacking, new endpapers, cleaning, leather and cloth bindings. Quote only "
        "after a member of staff has seen the book; typical work takes six to ten weeks.",
        "Gift cards are sold in any amount from five to five hundred pounds, never expire and can be used online.",
        "Events: readings on the first Thursday of each month at seven in the evening, a children's story hour "
        "every Saturday at ten, and a bookbinding workshop on the last Sunday of each month. Places are free but "
        "must be booked, because the reading room holds forty people.",
        "Never give legal, medical or financial advice, and never discuss other customers or their orders.",
        "Prices on the website include tax. Customers outside the country may pay import duties on delivery; say "
        "so before they order, not after.",
        "If a book is out of print, offer to search the second-hand trade; searches are free and take about two "
        "weeks, and the customer is under no obligation to buy what is found.",
        "Write in British English, in short paragraphs, without exclamation marks, and sign every message "
        "'The Hartley & Finch team'.",
        "Loyalty members collect one stamp for every ten pounds spent; ten stamps give a book token of ten pounds. "
        "Stamps cannot be exchanged for cash and expire after two years without a purchase.",
        "School and library orders receive a fifteen percent discount and thirty days to pay an invoice; ask for "
        "the institution's name, the order reference and a contact for the accounts department.",
        "Rare books are described with their edition, printing, binding, condition and any faults. Photographs are "
        "sent on request, and any rare book can be viewed in the shop by appointment before it is bought.",
        "Complaints are acknowledged within a day and answered by the manager within a week. Apologise once, state "
        "what will happen next, and give the customer a reference they can quote.",
        "Wrapping is free at the counter and costs two pounds for online orders; a handwritten card may be added.",
    ])),
    "Keep every answer under one hundred and fifty words unless the customer asks for more detail.",
])


def add_command(sub: Any) -> None:
    demo = sub.add_parser("demo", help="build the demo snapshot, serve it, and send it a chat and a streaming request")
    demo.add_argument("--model-dir", help="model directory to serve (default: SmolLM2-135M-Instruct, prepared "
                      "once into ~/.cache/warmstart/models/smollm2, or a random model of its shape when that "
                      "cannot be fetched)")
    demo.add_argument("--random-model", action="store_true", help="serve the random SmolLM2-135M-shaped model "
                      "(~/.cache/warmstart/demo-model) without trying to fetch the real one")
    demo.add_argument("--system-file", type=pathlib.Path, help="system prompt to snapshot (default: a long "
                      "built-in one)")
    demo.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (default auto: "
                      "bfloat16, which serves on every CPU kind)")
    demo.add_argument("--store", help="store to build into (default $WARMSTART_STORE or the local default)")
    demo.add_argument("--cache", type=pathlib.Path, help="local blob cache (default $WARMSTART_CACHE)")
    demo.add_argument("--port", type=port_number, default=8000, help="port to serve on; 0 picks a free one")
    demo.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per demo request (default 32)")
    demo.add_argument("--no-wait", action="store_true", help="stop the server after the demo requests")
    demo.add_argument("--json", action="store_true", help="print one JSON object and stop the server")
    demo.set_defaults(func=cmd_demo)


def default_model_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "warmstart" / "demo-model"


def ensure_demo_model(model_dir: pathlib.Path, *, quiet: bool = False) -> pathlib.Path:
    """Build the random SmolLM2-135M-shaped demo model into `model_dir` unless it is already there."""
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file() and any(
        model_dir.glob("*.safetensors")
    ):
        return model_dir
    from warmstart.runtime import random_model

    config_path = pathlib.Path(random_model.__file__).parent / "configs" / DEMO_CONFIG
    config = json.loads(config_path.read_text())
    if not quiet:
        print(f"building a random SmolLM2-135M-shaped model in {model_dir} (once) ...", file=sys.stderr)
    tmp = model_dir.with_name(model_dir.name + f".tmp-{os.getpid()}")
    try:
        random_model.make_random_model(tmp, config, seed=0, dtype="bfloat16")
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, model_dir)  # another process may have won the race; then theirs is as good
    except OSError as e:
        if not (model_dir / "config.json").is_file():
            raise CliError(f"cannot write the demo model to {model_dir}: {e} (try --model-dir DIR)") from None
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def demo_snapshot(model_dir: pathlib.Path, system_text: str, args: argparse.Namespace,
                  log: Callable[[str], None]) -> str:
    """The id of the demo snapshot in the store, built and tagged `demo` unless an up-to-date one is there."""
    from warmstart.handlers.cli.snapshots import user_errors

    with user_errors():
        from warmstart import runtime
        from warmstart.runtime.engine.dtype_choice import stored_dtype
        from warmstart.snapshot.errors import NotFound
        from warmstart.snapshot.format import Manifest, blob_id, file_blob_id
        from warmstart.snapshot.stores import open_store

        store = open_store(args.store)
        try:
            sid = store.get_ref(DEMO_REF)
            m = Manifest.decode(store.get_manifest(sid), where=f"snapshot {sid}").data
            sources = m["provenance"]["sources"]
            if (m["engine"]["version"] == runtime.__version__ and m["engine"]["dtype"] == stored_dtype(args.dtype)
                    and sources.get(f"system:{PREFIX_NAME}") == blob_id(system_text.encode())
                    and sources.get("config.json") == file_blob_id(model_dir / "config.json")):
                return sid
        except NotFound:
            pass
        from warmstart.snapshot.build import BuildError, BuildOptions, PrefixSpec, build_snapshot
        from warmstart.snapshot.cache import BlobCache
        from warmstart.snapshot.transfer import push_snapshot

        log(f"building the demo snapshot into {store.uri} ...")
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "system.txt"
            path.write_bytes(system_text.encode())
            options = BuildOptions(dtype=args.dtype, prefixes=[PrefixSpec(PREFIX_NAME, path, "system")])
            try:
                built = build_snapshot(model_dir, options, BlobCache(args.cache), log=log)
            except BuildError as e:
                raise CliError(str(e)) from None
        push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths, progress=False)
        store.set_ref(DEMO_REF, built.id)
        return built.id


def real_model_or_none(log: Callable[[str], None]) -> pathlib.Path | None:
    """SmolLM2-135M-Instruct prepared into the cache, or None (said why) when it cannot be fetched or converted."""
    from warmstart.snapshot.prepare_model import PrepareError, prepare_model

    try:
        return prepare_model("smollm2", log=log)
    except (PrepareError, OSError) as e:
        log(f"the real SmolLM2-135M-Instruct is not available ({e}); serving a random model of its shape")
        return None


def choose_model_dir(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[pathlib.Path, bool]:
    """The directory to serve and whether its weights are real."""
    if args.model_dir:  # a directory that is not there yet gets the random model
        return ensure_demo_model(pathlib.Path(args.model_dir).expanduser(), quiet=args.json), True
    real = None if args.random_model else real_model_or_none(log)
    if real is not None:
        return real, True
    return ensure_demo_model(default_model_dir(), quiet=args.json), False


def cmd_demo(args: argparse.Namespace) -> int:
    quiet = args.json
    log: Callable[[str], None] = (lambda _: None) if quiet else (lambda m: print(m, file=sys.stderr))
    model_dir, real_weights = choose_model_dir(args, log)
    try:
        system_text = args.system_file.read_text(encoding="utf-8") if args.system_file else DEMO_SYSTEM_PROMPT
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read --system-file {args.system_file}: {e}") from None
    sid = demo_snapshot(model_dir, system_text, args, log)

    server = Server(args, quiet)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Stopped any other way than Ctrl-C, the demo still stops its server rather than orphan it on the port.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    try:
        url = server.wait_for("listening")["url"]
        server.wait_for("ready")
        client = Client(url, os.environ.get("WARMSTART_API_KEY"))
        chat = client.chat(system_text, args.max_tokens)
        if not quiet:
            usage = chat["usage"]
            print(f"snapshot {sid} ({DEMO_REF}) serving at {url}\n")
            print(f"chat: {usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} prompt tokens "
                  f"came from the snapshot's system prompt\n  {chat['choices'][0]['message']['content']!r}")
            print("stream: ", end="", flush=True)
        chunks = list(client.stream(args.max_tokens, echo=not quiet))
        status = client.get("/status")
        result = {"snapshot_id": sid, "url": url, "chat": chat, "stream_chunks": chunks,
                  "stream_text": "".join(chunks), "status": status}
        if not quiet:
            print("\n")
            print_timeline(status)
            print(f"\ntry it:\n  {curl_line(url, client.key is not None)}")
        if args.json or args.no_wait:
            result["server_exit_code"] = server.stop()
            if args.json:
                print(json.dumps(result))
            return 0
        note = "" if real_weights else " (random weights: the text is gibberish by design)"
        print(f"\nserving at {url} until Ctrl-C{note}")
        return server.wait()
    except KeyboardInterrupt:
        server.stop()
        return 0
    finally:
        server.kill()


class Server:
    """`warmstart serve demo` as a child process whose stdout (one JSON line per event) is read by a thread."""

    def __init__(self, args: argparse.Namespace, quiet: bool) -> None:
        cmd = [sys.executable, "-m", __package__, "serve", DEMO_REF, "--port", str(args.port)]
        for flag, value in (("--store", args.store), ("--cache", args.cache)):
            if value is not None:
                cmd += [flag, str(value)]
        # Quiet, its stderr is kept for the error message; its own session, so that Ctrl-C reaches only this
        # process, which then stops the server the way a platform does (SIGTERM, drain, exit 0).
        self.stderr = tempfile.TemporaryFile(mode="w+") if quiet else None  # noqa: SIM115 - lives with the child
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     start_new_session=True, cwd=pathlib.Path(__file__).resolve().parents[2])
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.events.put(json.loads(line))
        self.events.put(None)

    def wait_for(self, phase: str) -> dict[str, Any]:
        while True:
            try:
                event = self.events.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                raise CliError(f"the server did not report {phase!r} within {READY_TIMEOUT_S:.0f} s") from None
            if event is None:
                raise CliError(f"the server exited with status {self.proc.wait()} before it was {phase}"
                               f"{self._last_error()}")
            if event.get("event") == "error":
                raise CliError(f"the server failed: {event.get('message')}")
            if event.get("phase") == phase:
                return event

    def _last_error(self) -> str:
        if self.stderr is None:
            return " (its error is above)"
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().splitlines() if line.strip()]
        return f": {lines[-1]}" if lines else ""

    def stop(self) -> int:
        """SIGTERM, as a platform stops an instance: in-flight requests finish, then it exits (0 when clean)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def wait(self) -> int:
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Client:
    """Just enough of an OpenAI client, on the standard library."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = url
        self.key = key

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        import urllib.error  # here, not at the top: every `warmstart` command imports this module
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=READY_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise CliError(f"{path} answered {e.code}: {message}") from None
        except OSError as e:
            raise CliError(f"cannot reach the server at {self.url}: {e}") from None

    def get(self, path: str) -> Any:
        with self._request(path) as r:
            return json.load(r)

    def chat(self, system_text: str, max_tokens: int) -> Any:
        body = {"model": DEMO_REF, "max_tokens": max_tokens, "temperature": 0.7, "seed": 1,
                "messages": [{"role": "system", "content": system_text}, {"role": "user", "content": USER_QUESTION}]}
        with self._request("/v1/chat/completions", body) as r:
            return json.load(r)

    def stream(self, max_tokens: int, echo: bool) -> Iterator[str]:
        body = {"model": DEMO_REF, "max_tokens": max_tokens, "temperature": 0.7, "seed": 2, "stream": True,
                "prompt": "Once upon a time, in a small village by the sea,"}
        with self._request("/v1/completions", body) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[len("data: "):])["choices"]
                text = choices[0]["text"] if choices else ""
                if echo:
                    print(text, end="", flush=True)
                yield text


def print_timeline(status: dict[str, Any]) -> None:
    print("cold start of that server, in seconds since its process started:")
    details = status.get("details", {})
    for phase, seconds in status["phases"].items():
        note = ""
        if phase == "blobs" and phase in details:
            d = details[phase]
            note = (f"  ({d['blobs_downloaded']} of {d['blobs_total']} blobs pulled, {d['bytes_downloaded']:,} bytes)"
                    if d["blobs_downloaded"] else f"  (all {d['blobs_total']} blobs already in the local cache)")
        print(f"  {phase:<16}{seconds:8.3f}{note}")


def curl_line(url: str, with_key: bool) -> str:
    auth = " -H \"Authorization: Bearer $WARMSTART_API_KEY\"" if with_key else ""
    body = json.dumps({"model": DEMO_REF, "max_tokens": 32, "messages": [{"role": "user", "content": "Hello!"}]})
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
