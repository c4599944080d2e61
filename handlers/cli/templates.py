"""`warmstart template PLATFORM`: render a platform's deployment files with the snapshot pinned by id.

The templates are jinja2 files in the project's top-level `templates/` directory. From a source checkout (or
an editable install) they are read there; a wheel installs them as data files under
`share/warmstart/templates`, found through the installed distribution's file list (see `templates_dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from warmstart.handlers.errors import CliError, non_negative_int, positive_int
from warmstart.runtime.engine.options import EngineOptions

PORT = 8080
PYTHON_VERSION = "3.11"  # of the images: the version the project is tested with
TORCH_REQUIREMENT = "torch==2.13.0"  # the build the tests run against (Makefile's TORCH); CUDA wheels on Linux
RUNPOD_REQUIREMENT = "runpod>=1.7"
CLOUD_RUN_GPUS = ("nvidia-l4", "nvidia-rtx-pro-6000")
DEVICE = "cuda"  # what the instances' `warmstart serve --device` is given, unless docker is rendered for the CPU
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU-only wheels: a fraction of the CUDA build
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one (else site-packages)
NAME = re.compile(r"^[a-z]([-a-z0-9]{0,47}[a-z0-9])?$")  # DNS-1035 label, short enough for every platform


@dataclass(frozen=True)
class Platform:
    summary: str
    files: tuple[tuple[str, str], ...]  # (template under templates/, file written to --out)
    deploy: str  # the one command, formatted with the rendering's values
    default_gpu: str | None = None
    needs_s3: bool = True  # instances elsewhere cannot read a local directory store


IMAGE_FILES = (("docker/Dockerfile.j2", "Dockerfile"),)
PLATFORMS: dict[str, Platform] = {
    "docker": Platform("a container image running `warmstart serve`", IMAGE_FILES,
                       "docker build -f {out}/Dockerfile -t {image} . && docker run {gpus_flag}-p {port}:{port} "
                       "-v warmstart-cache:{cache_dir}{store_mount} {image}", needs_s3=False),
    "cloudrun": Platform("Google Cloud Run service with a GPU", (("cloudrun/service.yaml.j2", "service.yaml"),
                                                                 *IMAGE_FILES),
                         "gcloud run services replace {out}/service.yaml --region {region}", default_gpu="nvidia-l4"),
    "knative": Platform("Knative Serving Service", (("knative/service.yaml.j2", "service.yaml"), *IMAGE_FILES),
                        "kubectl apply -f {out}/service.yaml"),
    "kserve": Platform("KServe InferenceService with IRSA bucket access",
                       (("kserve/serviceaccount.yaml.j2", "serviceaccount.yaml"),
                        ("kserve/inferenceservice.yaml.j2", "inferenceservice.yaml"), *IMAGE_FILES),
                       "kubectl apply -f {out}/serviceaccount.yaml -f {out}/inferenceservice.yaml"),
    "aws": Platform("AWS CloudFormation: bucket, roles, SageMaker async endpoint scaling to zero",
                    (("aws/template.yaml.j2", "template.yaml"), *IMAGE_FILES),
                    "aws cloudformation deploy --template-file {out}/template.yaml --stack-name {name} "
                    "--capabilities CAPABILITY_IAM --region {region} --parameter-overrides ImageUri={image}",
                    default_gpu="ml.g5.xlarge"),
    "modal": Platform("Modal app with a GPU class and memory snapshots", (("modal/modal_app.py.j2", "modal_app.py"),),
                      "modal deploy {out}/modal_app.py", default_gpu="L4"),
    "runpod": Platform("RunPod serverless worker (handler.py and its Dockerfile)",
                       (("runpod/handler.py.j2", "handler.py"), ("runpod/Dockerfile.j2", "Dockerfile")),
                       "docker build -f {out}/Dockerfile -t {image} . && docker push {image}  "
                       "(then create a serverless endpoint from {image} with a {gpu} GPU, workers min {min_instances})",
                       default_gpu="NVIDIA L4"),
}


IMAGE_PLATFORMS = [name for name, p in PLATFORMS.items() if IMAGE_FILES[0] in p.files]


def add_command(sub: Any) -> None:
    p = sub.add_parser("template", help="render deployment files for a platform, the snapshot pinned by id",
                       description=f"Platforms: {', '.join(PLATFORMS)}.")
    p.add_argument("platform", metavar="PLATFORM", help=f"one of: {', '.join(PLATFORMS)}")
    p.add_argument("--snapshot", metavar="REF", help="snapshot id, unique id prefix or ref name (pinned to its id)")
    p.add_argument("--store", metavar="URI", help="s3://BUCKET/PREFIX the instances read (default $WARMSTART_STORE; "
                   "docker: else the local store, ~/.cache/warmstart/store, mounted into the container read-only)")
    p.add_argument("--gpu", metavar="TYPE", help="GPU type (cloudrun: nvidia-l4; aws: ml.g5.xlarge; modal: L4)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="docker: cpu renders an image that serves on the CPU (PyTorch's CPU wheel, no GPU asked of "
                        "docker run); every platform runs on a GPU by default (cuda)")
    p.add_argument("--min-instances", type=non_negative_int, default=0, metavar="N",
                   help="instances kept warm (default 0: scale to zero)")
    p.add_argument("--max-instances", type=positive_int, default=4, metavar="N", help="(default 4)")
    p.add_argument("--out", type=Path, metavar="DIR", help="where to write the files (default deploy/PLATFORM)")
    p.add_argument("--name", default="warmstart", help="service, app or stack name (default warmstart)")
    p.add_argument("--image", help="container image reference (default warmstart:<first 12 digits of the id>)")
    p.add_argument("--namespace", help="knative, kserve: the Kubernetes namespace (default: kubectl's)")
    p.add_argument("--region", help="cloud region (cloudrun: us-central1, aws: us-east-1)")
    p.add_argument("--role-arn", help="kserve: the IAM role the predictor's service account assumes (IRSA)")
    p.add_argument("--concurrency", type=positive_int, default=EngineOptions.max_num_seqs,
                   help="requests one instance runs at once: the engine's --max-num-seqs and the platform's "
                        f"container concurrency (default {EngineOptions.max_num_seqs})")
    p.add_argument("--bake", action="store_true",
                   help="image platforms: pull the snapshot into the image at build time instead of at cold start")
    p.add_argument("--keep-ref", action="store_true",
                   help="deploy the ref name itself (it moves with the ref) instead of pinning the id it names now")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(func=cmd_template)


def cmd_template(args: argparse.Namespace) -> int:
    platform = PLATFORMS.get(args.platform)
    if platform is None:
        raise CliError(f"unknown platform {args.platform!r}; expected one of: {', '.join(PLATFORMS)}")
    store_uri = args.store or os.environ.get("WARMSTART_STORE") or (None if platform.needs_s3 else local_store())
    missing = [flag for flag, value in (("--snapshot REF", args.snapshot),
                                        ("--store URI (an s3://BUCKET/PREFIX store its instances can read)", store_uri))
               if not value]
    if args.platform == "kserve" and not args.role_arn:
        missing.append("--role-arn ARN (the IAM role for IRSA)")
    if missing or not store_uri:
        raise CliError(f"warmstart template {args.platform} needs {', '.join(missing)}")
    check_options(args, platform)
    values = resolve_values(args, platform, store_uri)
    out = (args.out or Path("deploy") / args.platform).expanduser()
    written = render(args.platform, values, out)
    command = platform.deploy.format(out=out, **values)
    result = {"platform": args.platform, "snapshot": values["snapshot"], "snapshot_id": values["snapshot_id"],
              "files": [str(p) for p in written], "deploy": command}
    if args.json:
        print(json.dumps(result))
    else:
        pinned = "" if values["snapshot"] == values["snapshot_id"] else f" (ref, now {values['snapshot_id']})"
        print(f"{PLATFORMS[args.platform].summary} for snapshot {values['snapshot']}{pinned}:", file=sys.stderr)
        for path in written:
            print(f"  wrote {path}", file=sys.stderr)
        print("deploy with:", file=sys.stderr)
        print(command)
    return 0


def check_options(args: argparse.Namespace, platform: Platform) -> None:
    """The checks that need no store, made before the store is contacted."""
    for flag, value in (("--name", args.name), ("--namespace", args.namespace)):
        if value and not NAME.match(value):
            raise CliError(f"{flag} {value!r} is not a valid name; use lowercase letters, digits and '-', starting "
                           "with a letter (at most 49 characters)")
    gpu = args.gpu or platform.default_gpu
    if args.platform == "cloudrun" and gpu not in CLOUD_RUN_GPUS:
        raise CliError(f"--gpu {gpu!r} is not a Cloud Run GPU; expected one of: {', '.join(CLOUD_RUN_GPUS)}")
    if args.platform == "aws" and not re.match(r"^ml\.(g|p)\d", gpu or ""):
        raise CliError(f"--gpu {gpu!r} is not a SageMaker GPU instance type; expected one like ml.g5.xlarge, "
                       "ml.g6.xlarge or ml.p4d.24xlarge")
    if args.min_instances > args.max_instances:
        raise CliError(f"--min-instances {args.min_instances} is more than --max-instances {args.max_instances}")
    if args.device == "cpu" and args.platform != "docker":
        raise CliError(f"--device cpu is for docker; {args.platform} instances run on a GPU (leave --device out)")
    if args.bake and IMAGE_FILES[0] not in platform.files:
        raise CliError(f"--bake is for platforms that run warmstart's serving image ({', '.join(IMAGE_PLATFORMS)}); "
                       f"not {args.platform}")


def resolve_values(args: argparse.Namespace, platform: Platform, store_uri: str) -> dict[str, Any]:
    """Everything the templates use, the snapshot resolved (and pinned) through the store."""
    from urllib.parse import urlparse

    from warmstart.snapshot.errors import StoreError
    from warmstart.snapshot.format import FormatError
    from warmstart.snapshot.refs import resolve_ref
    from warmstart.snapshot.stores import open_store

    try:  # not snapshots.user_errors: that imports the runtime (torch), which rendering has no use for
        store = open_store(store_uri)
        parsed = urlparse(store.uri)
        s3 = parsed.scheme == "s3"
        if platform.needs_s3 and not s3:
            raise CliError(f"{args.platform} instances cannot read the local store {store.uri}; push the snapshot to "
                           "an s3://BUCKET/PREFIX store (warmstart build --store s3://...) and pass that as --store")
        if args.bake and not s3:
            raise CliError(f"--bake pulls the snapshot while the image builds, which cannot read the local store "
                           f"{store.uri}; push the snapshot to an s3://BUCKET/PREFIX store and pass that as --store")
        snapshot_id = resolve_ref(store, args.snapshot)
    except (StoreError, FormatError) as e:
        raise CliError(str(e)) from None
    gpu = args.gpu or platform.default_gpu
    device = args.device or DEVICE
    snapshot = args.snapshot.strip() if args.keep_ref else snapshot_id
    prefix = parsed.path.strip("/")
    cache_dir = "/cache"
    # A local store (docker only) is mounted read-only into the container at /store.
    container_store = store.uri if s3 else "/store"
    store_mount = "" if s3 else f" -v {urlparse(store.uri).path or store.uri}:/store:ro"
    endpoint = os.environ.get("AWS_ENDPOINT_URL") if s3 else None
    default_region = {"cloudrun": "us-central1", "aws": "us-east-1"}.get(args.platform, "")
    return {
        "platform": args.platform,
        "snapshot": snapshot,
        "snapshot_id": snapshot_id,
        "store": store.uri,
        "container_store": container_store,
        "store_mount": store_mount,
        # An S3-compatible store (MinIO, R2, GCS interop) needs its endpoint in the instances too.
        "store_env": {"AWS_ENDPOINT_URL": endpoint} if endpoint else {},
        "bucket": parsed.netloc,
        "prefix": f"{prefix}/" if prefix else "",
        "bake": args.bake,
        "create_bucket": "false",  # rendering just read the snapshot from this bucket, so it exists
        "gpu": gpu,
        "min_instances": args.min_instances,
        "max_instances": args.max_instances,
        "name": args.name,
        "model_name": args.name,
        "namespace": args.namespace or "",
        "service_account": f"{args.name}-reader" if args.platform == "kserve" else "",
        "role_arn": args.role_arn or "",
        "image": args.image or f"warmstart:{snapshot_id[:12]}",
        "region": args.region or default_region,
        "concurrency": args.concurrency,
        "port": PORT,
        "cache_dir": cache_dir,
        # On a GPU (every platform but a docker image rendered with --device cpu), `cuda` makes an instance without
        # a usable one fail at start, saying so, rather than serve on its CPU (`auto` would); the images read it
        # as WARMSTART_DEVICE.
        "device": device,
        "gpus_flag": "--gpus all " if device == "cuda" else "",
        "torch_index": CPU_TORCH_INDEX if device == "cpu" else "",
        "cache_size": "16Gi",
        "cpu": 8,
        "memory": "32Gi",
        "gpu_zonal_redundancy_disabled": "true",
        "request_timeout": 600,
        # Startup probe: every 2 s for up to 240 s (Cloud Run's limit on failureThreshold x periodSeconds).
        "probe_period": 2,
        "probe_failures": 120,
        "health_start_period": 240,
        "startup_timeout": 600,
        "retention_period": "5m",
        "scaledown_window": 300,
        "backlog_target": 5,
        "volume": f"{args.name}-cache",
        "secret": f"{args.name}-aws",
        "python_version": PYTHON_VERSION,
        "torch_requirement": TORCH_REQUIREMENT,
        "runpod_requirement": RUNPOD_REQUIREMENT,
        "requirements": requirements(),
        "app_file": "modal_app.py",
        "dockerfile_path": "Dockerfile",
        "handler_path": "handler.py",
    }


def local_store() -> str:
    """The store the other commands use when none is named: the local one, which docker mounts."""
    from warmstart.snapshot.store import default_store_dir

    return str(default_store_dir())


def requirements() -> list[str]:
    """warmstart's own runtime dependencies, for images built without its source (Modal's): from the source
    tree's pyproject.toml, else from the installed distribution's metadata."""
    pyproject = SOURCE_ROOT / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        reqs = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    else:
        try:
            reqs = [r.split(";")[0].strip() for r in metadata.requires("warmstart") or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            reqs = []
    return [TORCH_REQUIREMENT if r.startswith("torch") else r for r in reqs] or [TORCH_REQUIREMENT]


def render(platform: str, values: dict[str, Any], out: Path) -> list[Path]:
    """Write the platform's files into ``out``; returns their paths."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create {out}: {e.strerror}; pass another --out DIR") from None
    written = []
    for template, name in PLATFORMS[platform].files:
        path = out / name
        file_values = {**values, "dockerfile_path": str(out / "Dockerfile"), "handler_path": str(out / "handler.py")}
        path.write_text(env.get_template(template).render(**file_values))
        written.append(path)
    return written


def templates_dir() -> Path:
    """The templates: the source tree's `templates/` next to this package, else the installed data files."""
    here = SOURCE_ROOT / "templates"
    if (here / "docker" / "Dockerfile.j2").is_file():
        return here
    try:
        files = metadata.distribution("warmstart").files or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.as_posix().endswith("share/warmstart/templates/docker/Dockerfile.j2"):
            return Path(str(f.locate())).resolve().parent.parent
    raise CliError("the deployment templates are not installed (no templates/ next to the handlers package and no "
                   "share/warmstart/templates in the warmstart installation); reinstall warmstart")
