"""`warmstart template`: every platform rendered from a tiny snapshot in an S3 store (moto) and checked by its
ecosystem's own tools: cfn-lint, check-jsonschema (Knative Service and KServe InferenceService schemas,
vendored in tests/handlers/schemas), hadolint, yamllint, `modal` importing the app, and RunPod's local test runner
running the handler on a job. Each validator is also shown to reject a broken render."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cli import WARMSTART
from warmstart.handlers.cli.templates import PLATFORMS

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCHEMAS = Path(__file__).resolve().parent / "schemas"
BUCKET = "snapshots"
STORE = f"s3://{BUCKET}/models"

# Cloud Run's documented service.yaml annotation keys (cloud.google.com/run/docs/reference/yaml/v1, GPU and
# health-check pages) and its one nodeSelector key. Knative's schema lets any string through, so a typo
# in one of these would deploy as an annotation Cloud Run ignores or rejects.
CLOUD_RUN_ANNOTATIONS = {
    "run.googleapis.com/launch-stage", "run.googleapis.com/description", "run.googleapis.com/ingress",
    "run.googleapis.com/ingress-status", "run.googleapis.com/binary-authorization",
    "run.googleapis.com/binary-authorization-breakglass", "run.googleapis.com/minScale",
    "run.googleapis.com/maxScale", "run.googleapis.com/function-target", "run.googleapis.com/invoker-iam-disabled",
    "run.googleapis.com/iap-enabled", "run.googleapis.com/scalingMode", "run.googleapis.com/manualInstanceCount",
    "run.googleapis.com/custom-audiences", "run.googleapis.com/cpu-throttling", "run.googleapis.com/startup-cpu-boost",
    "run.googleapis.com/sessionAffinity", "run.googleapis.com/cloudsql-instances",
    "run.googleapis.com/execution-environment", "run.googleapis.com/vpc-access-connector",
    "run.googleapis.com/vpc-access-egress", "run.googleapis.com/network-interfaces",
    "run.googleapis.com/encryption-key",
    "run.googleapis.com/encryption-key-shutdown-hours", "run.googleapis.com/container-dependencies",
    "run.googleapis.com/gpu-zonal-redundancy-disabled", "run.googleapis.com/health-check-disabled",
    "run.googleapis.com/client-name", "run.googleapis.com/secrets", "run.googleapis.com/base-images",
    "run.googleapis.com/scaling-cpu-target", "run.googleapis.com/scaling-concurrency-target",
}
CLOUD_RUN_NODE_SELECTORS = {"run.googleapis.com/accelerator"}
CLOUD_RUN_PROBE_LIMIT_S = 240  # failureThreshold x periodSeconds; periodSeconds and timeoutSeconds 1..240


def cloud_run_problems(service: dict[str, Any]) -> list[str]:
    """What in a Cloud Run service.yaml is outside what Cloud Run documents."""
    problems = []
    template = service["spec"]["template"]
    annotations = {**service["metadata"].get("annotations", {}), **template["metadata"].get("annotations", {})}
    problems += [f"undocumented annotation {k}" for k in annotations
                 if k.startswith("run.googleapis.com/") and k not in CLOUD_RUN_ANNOTATIONS]
    problems += [f"undocumented nodeSelector {k}" for k in template["spec"].get("nodeSelector", {})
                 if k not in CLOUD_RUN_NODE_SELECTORS]
    for container in template["spec"]["containers"]:
        probe = container.get("startupProbe")
        if probe is None:
            problems.append("no startup probe")
            continue
        period, timeout = probe.get("periodSeconds", 10), probe.get("timeoutSeconds", 1)
        if not 1 <= period <= 240 or not 1 <= timeout <= min(period, 240):
            problems.append(f"probe periodSeconds {period} / timeoutSeconds {timeout} out of range")
        if probe.get("failureThreshold", 3) * period > CLOUD_RUN_PROBE_LIMIT_S:
            problems.append(f"startup probe allows more than {CLOUD_RUN_PROBE_LIMIT_S} s")
    return problems


def run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path = ROOT,
        timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env or os.environ.copy(),
                          cwd=cwd, timeout=timeout)


def warmstart(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run(*WARMSTART, *args, env=env)


@pytest.fixture(scope="module")
def s3_env(tiny_model_dir, moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a user whose store is an S3 bucket holding a tiny snapshot tagged `latest`."""
    import boto3

    cache = tmp_path_factory.mktemp("build-cache")
    env = {**os.environ, "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "WARMSTART_CACHE": str(cache),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WARMSTART_STORE", None)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    built = warmstart("build", tiny_model_dir("llama"), "--dtype", "float32", "--store", STORE, "--tag", "latest",
                      "--json", env=env)
    assert built.returncode == 0, built.stderr
    env["SNAPSHOT_ID"] = json.loads(built.stdout.strip().splitlines()[-1])["id"]
    return env


@pytest.fixture(scope="module")
def rendered(s3_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """platform -> the directory its files were rendered into (every platform, sample values)."""
    out = tmp_path_factory.mktemp("rendered")
    dirs = {}
    for platform in PLATFORMS:
        extra = ["--role-arn", "arn:aws:iam::123456789012:role/warmstart-reader"] if platform == "kserve" else []
        proc = warmstart("template", platform, "--snapshot", "latest", "--store", STORE, "--out", out / platform,
                         "--image", "registry.example.com/warmstart:test", "--min-instances", "0", *extra, "--json",
                         env=s3_env)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["snapshot"] == result["snapshot_id"] == s3_env["SNAPSHOT_ID"]
        dirs[platform] = out / platform
    return dirs


def yaml_files(rendered: dict[str, Path]) -> list[Path]:
    return sorted(p for d in rendered.values() for p in d.glob("*.yaml"))


def test_every_file_pins_the_snapshot_id_not_the_ref(rendered: dict[str, Path], s3_env: dict[str, str]) -> None:
    for platform, directory in rendered.items():
        names = {name for _, name in PLATFORMS[platform].files}
        assert {p.name for p in directory.iterdir()} == names
        text = "".join(p.read_text() for p in directory.iterdir())
        assert s3_env["SNAPSHOT_ID"] in text, platform
        assert "latest" not in text.replace("key: latest", ""), platform  # (Secret Manager's version alias)


def test_keep_ref_deploys_the_ref_name(s3_env: dict[str, str], tmp_path: Path) -> None:
    proc = warmstart("template", "knative", "--snapshot", "latest", "--store", STORE, "--out", tmp_path,
                     "--keep-ref", "--namespace", "serving", "--json", env=s3_env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["snapshot"] == "latest" and result["snapshot_id"] == s3_env["SNAPSHOT_ID"]
    service = yaml.safe_load((tmp_path / "service.yaml").read_text())
    assert service["metadata"]["namespace"] == "serving"
    env = service["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "WARMSTART_SNAPSHOT", "value": "latest"} in env


def test_human_output_names_the_files_and_the_deploy_command(s3_env: dict[str, str], tmp_path: Path) -> None:
    proc = warmstart("template", "cloudrun", "--snapshot", "latest", "--store", STORE, "--out", tmp_path,
                     "--gpu", "nvidia-l4", "--min-instances", "1", env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'service.yaml'}" in proc.stderr
    assert proc.stdout.strip() == f"gcloud run services replace {tmp_path}/service.yaml --region us-central1"
    annotations = yaml.safe_load((tmp_path / "service.yaml").read_text())["spec"]["template"]["metadata"]["annotations"]
    assert annotations["autoscaling.knative.dev/minScale"] == "1"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["template", "heroku", "--snapshot", "x", "--store", STORE], "expected one of: docker, cloudrun, knative"),
        (["template", "kserve", "--store", STORE], "needs --snapshot REF, --role-arn ARN"),
        (["template", "aws", "--snapshot", "latest"], "needs --store URI"),
        (["template", "cloudrun", "--snapshot", "nosuch", "--store", STORE], "no snapshot or ref 'nosuch'"),
        (["template", "cloudrun", "--snapshot", "latest", "--store", STORE, "--gpu", "h100"], "nvidia-l4"),
        (["template", "aws", "--snapshot", "latest", "--store", STORE, "--gpu", "ml.m5.large"], "GPU instance"),
        (["template", "modal", "--snapshot", "latest", "--store", "LOCAL"], "cannot read the local store"),
        (["template", "docker", "--snapshot", "latest", "--store", STORE, "--min-instances", "9"], "--max-instances"),
        (["template", "runpod", "--snapshot", "latest", "--store", STORE, "--bake"], "--bake is for platforms"),
        (["template", "knative", "--snapshot", "latest", "--store", STORE, "--name", "My_Svc"], "not a valid name"),
        (["template", "docker", "--snapshot", "latest", "--store", "LOCAL", "--bake"], "cannot read the local store"),
        (["template", "cloudrun", "--snapshot", "latest", "--store", STORE, "--device", "cpu"],
         "--device cpu is for docker"),
    ],
)
def test_bad_requests_are_one_clear_sentence(s3_env: dict[str, str], tmp_path: Path, args: list[str],
                                             message: str) -> None:
    args = [str(tmp_path / "store") if a == "LOCAL" else a for a in args]
    (tmp_path / "store").mkdir()
    proc = warmstart(*args, "--out", tmp_path / "out", env=s3_env)
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr.startswith("warmstart: error:") and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_docker_for_the_cpu_from_the_local_default_store(tiny_model_dir, tmp_path: Path) -> None:
    """With no --store and no $WARMSTART_STORE, docker renders from the store every other command defaults to (it
    mounts it); --device cpu gives an image with PyTorch's CPU wheel that asks docker run for no GPU."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("WARMSTART_STORE", "WARMSTART_CACHE"):
        env.pop(name, None)
    built = warmstart("build", tiny_model_dir("llama"), "--dtype", "float32", "--tag", "latest", "--json", env=env)
    assert built.returncode == 0, built.stderr
    store = Path(json.loads(built.stdout.strip().splitlines()[-1])["store"])
    assert tmp_path in store.parents
    proc = warmstart("template", "docker", "--snapshot", "latest", "--device", "cpu", "--out", tmp_path / "out",
                     "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    deploy = json.loads(proc.stdout.strip().splitlines()[-1])["deploy"]
    assert f"-v {store}:/store:ro" in deploy and "--gpus" not in deploy
    dockerfile = tmp_path / "out" / "Dockerfile"
    assert hadolint(dockerfile).returncode == 0, hadolint(dockerfile).stdout
    build_stage, final = dockerfile.read_text().split("\nFROM ")[1:][0], dockerfile.read_text().split("\nFROM ")[-1]
    assert "--index-url https://download.pytorch.org/whl/cpu" in build_stage
    assert "WARMSTART_DEVICE=cpu" in final and "gcc" not in final


def test_an_unreachable_store_is_a_clear_error(s3_env: dict[str, str], tmp_path: Path) -> None:
    env = {**s3_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"}
    proc = warmstart("template", "aws", "--snapshot", "latest", "--store", STORE, "--out", tmp_path, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("warmstart: error:") and BUCKET in proc.stderr
    assert not (tmp_path / "template.yaml").exists()


# -- the ecosystems' validators ----------------------------------------------------------------------------


def cfn_lint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return run(BIN / "cfn-lint", "--format", "parseable", *paths)


def test_cloudformation_passes_cfn_lint(rendered: dict[str, Path]) -> None:
    proc = cfn_lint(rendered["aws"] / "template.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resources = yaml.safe_load(_without_intrinsics((rendered["aws"] / "template.yaml").read_text()))["Resources"]
    bucket = resources["SnapshotBucket"]["Properties"]
    assert bucket["VersioningConfiguration"]["Status"] == "Enabled"
    assert all(bucket["PublicAccessBlockConfiguration"].values())
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
    (deny,) = resources["SnapshotBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    serve_actions = {a for st in resources["ServeRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
                     for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    assert "s3:PutObject" in serve_actions and "s3:DeleteObject" not in serve_actions  # puts only under async/
    assert resources["ScalableTarget"]["Properties"]["MinCapacity"] == "REF MinInstances"
    tracking = resources["BacklogTracking"]["Properties"]["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["CustomizedMetricSpecification"]["MetricName"] == "ApproximateBacklogSizePerInstance"
    assert resources["BacklogWithoutCapacityAlarm"]["Properties"]["MetricName"] == "HasBacklogWithoutCapacity"
    parameters = yaml.safe_load(_without_intrinsics((rendered["aws"] / "template.yaml").read_text()))["Parameters"]
    assert parameters["MinInstances"]["Default"] == 0 and parameters["InstanceType"]["Default"] == "ml.g5.xlarge"


def test_cfn_lint_rejects_a_broken_template(rendered: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "template.yaml"
    text = (rendered["aws"] / "template.yaml").read_text()
    broken.write_text(text.replace("ScalableDimension: sagemaker:variant:DesiredInstanceCount",
                                   "ScalableDimension: sagemaker:variant:DesiredInstances"))
    assert cfn_lint(broken).returncode != 0


def check_jsonschema(schema: str, tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    schema_file = tmp_path / schema
    schema_file.write_bytes(gzip.decompress((SCHEMAS / f"{schema}.gz").read_bytes()))
    return run(BIN / "check-jsonschema", "--schemafile", schema_file, *files)


def test_knative_and_cloud_run_services_match_the_knative_schema(rendered: dict[str, Path], tmp_path: Path) -> None:
    proc = check_jsonschema("knative-serving-service-v1.json", tmp_path, rendered["knative"] / "service.yaml",
                            rendered["cloudrun"] / "service.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kserve_inference_service_matches_its_schema(rendered: dict[str, Path], tmp_path: Path) -> None:
    path = rendered["kserve"] / "inferenceservice.yaml"
    proc = check_jsonschema("kserve-inferenceservice-v1beta1.json", tmp_path, path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    predictor = yaml.safe_load(path.read_text())["spec"]["predictor"]
    assert predictor["minReplicas"] == 0 and predictor["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    account = yaml.safe_load((rendered["kserve"] / "serviceaccount.yaml").read_text())
    assert predictor["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")


def test_the_schemas_reject_broken_services(rendered: dict[str, Path], tmp_path: Path) -> None:
    knative = tmp_path / "knative.yaml"
    knative.write_text((rendered["knative"] / "service.yaml").read_text().replace(
        "containerConcurrency: 64", "containerConcurrency: lots"))
    assert check_jsonschema("knative-serving-service-v1.json", tmp_path, knative).returncode != 0
    kserve = tmp_path / "kserve.yaml"
    kserve.write_text((rendered["kserve"] / "inferenceservice.yaml").read_text().replace(
        "minReplicas: 0", "minReplicas: none"))
    assert check_jsonschema("kserve-inferenceservice-v1beta1.json", tmp_path, kserve).returncode != 0


def test_cloud_run_uses_only_documented_annotations_and_probe_limits(rendered: dict[str, Path]) -> None:
    service = yaml.safe_load((rendered["cloudrun"] / "service.yaml").read_text())
    assert cloud_run_problems(service) == []
    spec = service["spec"]["template"]["spec"]
    assert spec["nodeSelector"]["run.googleapis.com/accelerator"] == "nvidia-l4"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["containerConcurrency"] == 64
    assert service["spec"]["template"]["metadata"]["annotations"]["run.googleapis.com/cpu-throttling"] == "false"


def test_the_cloud_run_check_catches_a_typo_and_a_long_probe(rendered: dict[str, Path]) -> None:
    service = yaml.safe_load((rendered["cloudrun"] / "service.yaml").read_text())
    template = service["spec"]["template"]
    template["metadata"]["annotations"]["run.googleapis.com/gpu-type"] = "nvidia-l4"
    template["spec"]["containers"][0]["startupProbe"]["failureThreshold"] = 500
    problems = cloud_run_problems(service)
    assert "undocumented annotation run.googleapis.com/gpu-type" in problems
    assert "startup probe allows more than 240 s" in problems


def hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return run(BIN / "hadolint", "--no-color", *paths)


def test_dockerfiles_pass_hadolint(rendered: dict[str, Path]) -> None:
    docker, runpod = rendered["docker"] / "Dockerfile", rendered["runpod"] / "Dockerfile"
    proc = hadolint(docker, runpod)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in (docker, runpod):
        final = path.read_text().split("\nFROM ")[-1]  # the last stage: what the image ships
        assert "USER 10001" in final and "build-essential" not in final and "make" not in final.split()
        # Triton compiles its CUDA launcher with the system C compiler the first time a kernel runs on a GPU.
        assert "install -y --no-install-recommends gcc libc6-dev" in final
    assert "HEALTHCHECK" in docker.read_text() and "/health" in docker.read_text()


def test_a_baked_image_carries_the_snapshot_and_mounts_no_cache_over_it(s3_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    for platform in ("docker", "cloudrun"):
        proc = warmstart("template", platform, "--snapshot", "latest", "--store", STORE, "--bake",
                         "--out", tmp_path / platform, env=s3_env)
        assert proc.returncode == 0, proc.stderr
    dockerfile = tmp_path / "docker" / "Dockerfile"
    assert hadolint(dockerfile).returncode == 0, hadolint(dockerfile).stdout
    text = dockerfile.read_text()
    assert f"warmstart pull {s3_env['SNAPSHOT_ID']} --store {STORE}" in text and "--mount=type=secret,id=aws" in text
    final = text.split("\nFROM ")[-1]
    assert "COPY --from=snapshot" in final and "VOLUME" not in final
    spec = yaml.safe_load((tmp_path / "cloudrun" / "service.yaml").read_text())["spec"]["template"]["spec"]
    assert "volumes" not in spec and "volumeMounts" not in spec["containers"][0]
    assert cloud_run_problems(yaml.safe_load((tmp_path / "cloudrun" / "service.yaml").read_text())) == []


def test_hadolint_rejects_a_compiler_installed_unpinned(rendered: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text((rendered["docker"] / "Dockerfile").read_text().replace(
        "COPY --from=build", "RUN apt-get update && apt-get install -y gcc\nCOPY --from=build", 1))
    assert hadolint(broken).returncode != 0


YAMLLINT_CONFIG = "{extends: default, rules: {line-length: {max: 120}}}"


def test_all_yaml_passes_yamllint(rendered: dict[str, Path]) -> None:
    files = yaml_files(rendered)
    assert len(files) == 5  # cloudrun, knative, kserve (2), aws
    proc = run(BIN / "yamllint", "--strict", "-f", "parsable", "-d", YAMLLINT_CONFIG, *files)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_yamllint_rejects_broken_yaml(rendered: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "service.yaml"
    text = (rendered["knative"] / "service.yaml").read_text()
    broken.write_text(text.replace("kind: Service", "kind: Service\nkind: X"))  # a duplicated key
    assert run(BIN / "yamllint", "--strict", "-d", YAMLLINT_CONFIG, broken).returncode != 0


MODAL_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("modal_app", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps({"app": module.app.name, "classes": sorted(module.app.registered_classes), "device": module.DEVICE}))
"""


def test_the_modal_app_imports_with_modal(rendered: dict[str, Path], s3_env: dict[str, str]) -> None:
    proc = run(sys.executable, "-c", MODAL_PROBE, rendered["modal"] / "modal_app.py", env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"app": "warmstart", "classes": ["Warmstart"],
                                                                "device": "cuda"}
    text = (rendered["modal"] / "modal_app.py").read_text()
    assert "enable_memory_snapshot=True" in text and 'gpu="L4"' in text
    assert '"torch==2.13.0"' in text and '"safetensors"' in text  # warmstart's dependencies go into the image
    mounted = ast.literal_eval(re.search(r"add_local_python_source\(([^)]*)\)", text).group(1) + ",")
    for name in mounted:  # modal mounts each package's folders as found here, under the package's own name
        spec = importlib.util.find_spec(name)
        assert spec and spec.submodule_search_locations, name
        assert all((Path(p) / "__init__.py").is_file() for p in spec.submodule_search_locations), name
    assert {m.split(".")[0] for m in mounted} == {"warmstart"} and len(mounted) == 3


def test_modal_rejects_a_broken_app(rendered: dict[str, Path], s3_env: dict[str, str], tmp_path: Path) -> None:
    broken = tmp_path / "modal_app.py"
    broken.write_text((rendered["modal"] / "modal_app.py").read_text().replace(
        "@modal.enter(snap=False)", "@modal.enter(snap=False)\n    @modal.asgi_app()"))
    assert run(sys.executable, "-c", MODAL_PROBE, broken, env=s3_env).returncode != 0


def runpod_job(handler: Path, job: dict[str, Any], env: dict[str, str], cache: Path) -> dict[str, Any]:
    proc = run(sys.executable, handler, "--test_input", json.dumps(job),
               env={**env, "WARMSTART_CACHE": str(cache), "WARMSTART_DEVICE": "cpu"}, cwd=handler.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in (proc.stdout + proc.stderr).splitlines():  # RunPod's local runner logs the job's result
        if "Job result:" in line or '"output"' in line:
            start = line.index("{")
            return ast.literal_eval(line[start:])  # type: ignore[no-any-return]  (a Python repr)
    raise AssertionError(f"no job result in the runner's output:\n{proc.stdout}\n{proc.stderr}")


def test_the_runpod_handler_runs_the_engine_on_a_job(rendered: dict[str, Path], s3_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    job = {"input": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "ignore_eos": True,
                     "temperature": 0}}
    result = runpod_job(rendered["runpod"] / "handler.py", job, s3_env, tmp_path / "cache")
    output = result["output"]
    assert output["object"] == "chat.completion" and output["system_fingerprint"] == s3_env["SNAPSHOT_ID"]
    assert output["usage"]["completion_tokens"] == 5 and output["choices"][0]["finish_reason"] == "length"


def test_the_runpod_handler_reports_a_bad_job(rendered: dict[str, Path], s3_env: dict[str, str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(key, s3_env[key])
    monkeypatch.setenv("WARMSTART_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WARMSTART_DEVICE", "cpu")
    spec = importlib.util.spec_from_file_location("runpod_handler", rendered["runpod"] / "handler.py")
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # loads the snapshot, as a worker does before its first job
    bad = worker.handler({"id": "j1", "input": {"messages": [{"role": "user", "content": "Hi"}], "temperature": -3}})
    assert set(bad) == {"error"} and "temperature" in bad["error"]
    assert set(worker.handler({"id": "j2", "input": "hello"})) == {"error"}
    ok = worker.handler({"id": "j3", "input": {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}})
    assert ok["object"] == "text_completion" and ok["usage"]["completion_tokens"] == 2


# -- the GPU -----------------------------------------------------------------------------------------------


def container_env(manifest: dict[str, Any]) -> dict[str, str]:
    spec = manifest["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec["predictor"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    return {e["name"]: e.get("value") for e in container["env"]}


def test_every_platform_asks_its_instances_for_the_gpu(rendered: dict[str, Path]) -> None:
    for platform, name in (("cloudrun", "service.yaml"), ("knative", "service.yaml"),
                           ("kserve", "inferenceservice.yaml")):
        manifest = yaml.safe_load((rendered[platform] / name).read_text())
        assert container_env(manifest)["WARMSTART_DEVICE"] == "cuda", platform
    template = yaml.safe_load(_without_intrinsics((rendered["aws"] / "template.yaml").read_text()))
    assert template["Resources"]["Model"]["Properties"]["PrimaryContainer"]["Environment"]["WARMSTART_DEVICE"] == "cuda"
    for platform in ("docker", "runpod"):
        final = (rendered[platform] / "Dockerfile").read_text().split("\nFROM ")[-1]
        assert "WARMSTART_DEVICE=cuda" in final, platform


ENTRYPOINT_PROBE = """
import json, sys
dockerfile = open(sys.argv[1]).read()
line = next(l for l in dockerfile.splitlines() if l.startswith("ENTRYPOINT "))
print(json.dumps(json.loads(line[len("ENTRYPOINT "):])))
"""


@pytest.mark.parametrize(("device_env", "args", "expected"), [
    ({}, ["serve"], ["--device", "cuda", "--host", "0.0.0.0", "--port", "8080"]),  # SageMaker's `serve` dropped
    ({"WARMSTART_DEVICE": "auto"}, ["--max-num-seqs", "8"],
     ["--device", "auto", "--host", "0.0.0.0", "--port", "8080", "--max-num-seqs", "8"]),
])
def test_the_image_entrypoint_serves_on_the_device_it_is_given(rendered: dict[str, Path], tmp_path: Path,
                                                              device_env: dict[str, str], args: list[str],
                                                              expected: list[str]) -> None:
    """The rendered ENTRYPOINT run by /bin/sh, as the container runtime runs it, with a stand-in `warmstart` that
    prints the arguments it was given."""
    entrypoint = json.loads(run(sys.executable, "-c", ENTRYPOINT_PROBE, rendered["docker"] / "Dockerfile").stdout)
    stub = tmp_path / "warmstart"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "WARMSTART_SNAPSHOT": "0123abcd", **device_env}
    proc = run(*entrypoint, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["serve", "0123abcd", *expected]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="shows what a worker without a GPU does")
def test_the_runpod_worker_without_a_gpu_fails_at_once_saying_so(rendered: dict[str, Path], s3_env: dict[str, str],
                                                                tmp_path: Path) -> None:
    env = {k: v for k, v in s3_env.items() if k != "WARMSTART_DEVICE"} | {"WARMSTART_CACHE": str(tmp_path / "c")}
    handler = rendered["runpod"] / "handler.py"
    proc = run(sys.executable, handler, "--test_input", '{"input": {"prompt": "Hi"}}', env=env, cwd=handler.parent)
    assert proc.returncode != 0
    assert "device 'cuda' was asked for" in proc.stderr and "sees no CUDA device" in proc.stderr, proc.stderr[-2000:]
    blobs = tmp_path / "c" / "blobs"
    assert not blobs.exists() or not any(blobs.iterdir())  # refused before anything was pulled


# -- SageMaker's container contract and the installed templates ----------------------------------------------


def test_sagemaker_ping_and_invocations(tiny_model_dir, tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from tests.support.serving import build_tiny_snapshot, ready_state
    from warmstart.handlers.server.app import create_app
    from warmstart.handlers.server.state import Limits

    state = ready_state(build_tiny_snapshot(tiny_model_dir("llama"), tmp_path), Limits(api_key="secret"))
    try:
        with TestClient(create_app(state)) as client:
            assert client.get("/ping").status_code == 200  # no key: SageMaker's health check sends none
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}
            assert client.post("/invocations", json=body).status_code == 401
            reply = client.post("/invocations", json=body, headers={"Authorization": "Bearer secret"})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        state.shutdown()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """warmstart installed from a wheel (not editable) under a private prefix; yields its site-packages."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy, so that the build leaves nothing in the checkout
    for name in ("runtime", "snapshot", "handlers", "templates"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheel = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "dist",
                source, timeout=600)
    assert wheel.returncode == 0, wheel.stderr
    (whl,) = (work / "dist").glob("warmstart-*.whl")
    prefix = work / "prefix"
    install = run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                  "--prefix", prefix, whl)
    assert install.returncode == 0, install.stderr
    (site,) = prefix.glob("lib/python*/site-packages")
    yield site
    shutil.rmtree(work, ignore_errors=True)


def test_an_installed_warmstart_renders_from_its_data_files(installed: Path, s3_env: dict[str, str],
                                                            tmp_path: Path) -> None:
    env = {**s3_env, "PYTHONPATH": str(installed)}
    probe = ("import warmstart.runtime, warmstart.snapshot, warmstart.handlers.cli.templates as d; "
             "print(warmstart.runtime.__file__, warmstart.snapshot.__file__, d.__file__, d.templates_dir())")
    where = run(sys.executable, "-c", probe, env=env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    *modules, templates = where.stdout.split()
    assert all(Path(m).is_relative_to(installed / "warmstart") for m in modules), modules
    assert Path(templates).is_relative_to(installed.parent.parent.parent)
    proc = run(*WARMSTART, "template", "aws", "--snapshot", "latest", "--store", STORE,
               "--out", tmp_path / "aws", "--json", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert cfn_lint(tmp_path / "aws" / "template.yaml").returncode == 0


def _without_intrinsics(text: str) -> str:
    """CloudFormation YAML with its short-form tags (!Ref X) as plain strings, for yaml.safe_load."""
    return text.replace("!Ref ", "REF ").replace("!Sub ", "SUB ").replace("!GetAtt ", "GETATT ").replace(
        "!If ", "IF ").replace("!Equals ", "EQUALS ")
