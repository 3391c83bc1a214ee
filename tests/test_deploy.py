"""The container and Kubernetes files (Dockerfile, deploy/k8s/) against the server they run: every manifest
parses, every probe path, port and metric name exists in ironlm (routes read from build_app, metric names from
server/metrics.py's exposition, flags parsed by `ironlm serve`'s own parser), and the drain time fits the
grace period."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import FakeEngine
from ironlm.cli import build_parser
from ironlm.cli_args import server_config_from_args
from ironlm.config import ServerConfig
from ironlm.engine import AsyncLLMEngine
from ironlm.server.api import build_app

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
ADAPTER_VALUES = K8S / "prometheus-adapter-values.yaml"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in _docs(K8S / name)]
    assert docs and all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs)
    return docs


@pytest.fixture(scope="module")
def server() -> tuple[set[str], set[str]]:
    """(GET routes, metric series names) of the real app."""
    engine = AsyncLLMEngine(FakeEngine(), start=False)
    app = build_app(engine, served_model_name="m", config=ServerConfig())
    routes = {r.path for r in app.routes if "GET" in getattr(r, "methods", set())}
    series = {s.name for f in text_string_to_metric_families(app.state.metrics.render().decode())
              for s in f.samples}
    return routes, series


def _of(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _entrypoint() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))


def _serve_config(container: dict[str, Any]) -> ServerConfig:
    """What `ironlm serve` makes of the image's entrypoint plus the container's args (unknown flags fail)."""
    argv = _entrypoint()[1:] + [str(a) for a in container.get("args", [])]
    assert argv[0] == "serve"
    return server_config_from_args(build_parser(argv).parse_args(argv))


def test_every_file_under_deploy_parses_and_kustomization_lists_every_manifest() -> None:
    files = sorted(p.name for p in K8S.glob("*.yaml"))
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed + ["kustomization.yaml", ADAPTER_VALUES.name]) == files
    for path in ROOT.joinpath("deploy").rglob("*.yaml"):
        assert _docs(path), path


def test_deployments_probe_serve_and_drain_consistently(manifests: list[dict[str, Any]],
                                                        server: tuple[set[str], set[str]]) -> None:
    routes, _ = server
    priority_classes = {d["metadata"]["name"] for d in _of(manifests, "PriorityClass")}
    deployments = _of(manifests, "Deployment")
    assert len(deployments) == 2
    for dep in deployments:
        pod = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        spec = pod["spec"]
        assert spec["priorityClassName"] in priority_classes
        (container,) = spec["containers"]
        config = _serve_config(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": config.port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] in routes, (probe, get["path"])
            assert ports.get(get["port"], get["port"]) == config.port
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/path"] in routes
        assert int(annotations["prometheus.io/port"]) == config.port
        assert container["resources"]["requests"].keys() >= {"cpu", "memory"}
        # Grace period: the preStop pause, then ironlm's drain of in-flight requests.
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        pause = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
        assert spec["terminationGracePeriodSeconds"] >= pause + config.drain_timeout
        # A draining pod answers /health 503: liveness must not kill it before the drain ends.
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > config.drain_timeout


def test_priority_tiers(manifests: list[dict[str, Any]]) -> None:
    values = {d["metadata"]["name"]: d for d in _of(manifests, "PriorityClass")}
    assert values["ironlm-latency-critical"]["value"] > values["ironlm-batch"]["value"]
    assert values["ironlm-batch"].get("preemptionPolicy") == "Never"
    tiers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["priorityClassName"]
             for d in _of(manifests, "Deployment")}
    assert tiers == {"ironlm": "ironlm-latency-critical", "ironlm-batch": "ironlm-batch"}


def test_services_pdbs_and_hpas_point_at_the_deployments(manifests: list[dict[str, Any]]) -> None:
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in _of(manifests, "Deployment")}

    def selected(selector: dict[str, str]) -> list[str]:
        return [n for n, t in pods.items() if selector.items() <= t["metadata"]["labels"].items()]

    for svc in _of(manifests, "Service"):
        (name,) = selected(svc["spec"]["selector"])
        port_names = {p["name"] for c in pods[name]["spec"]["containers"] for p in c["ports"]}
        assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    pdbs = _of(manifests, "PodDisruptionBudget")
    assert sorted(n for p in pdbs for n in selected(p["spec"]["selector"]["matchLabels"])) == sorted(pods)
    hpas = _of(manifests, "HorizontalPodAutoscaler")
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == sorted(pods)
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_hpa_metric_is_a_server_metric_through_the_adapter(manifests: list[dict[str, Any]],
                                                           server: tuple[set[str], set[str]]) -> None:
    _, series = server
    assert "ironlm:num_requests_waiting" in series
    # What the Prometheus adapter exposes: each rule's series renamed by its name.matches/as.
    exposed = {}
    for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]:
        source = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
        assert source in series, source
        renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), source)
        exposed[renamed] = source
    for hpa in _of(manifests, "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods"
            assert exposed[metric["pods"]["metric"]["name"]] == "ironlm:num_requests_waiting"


def test_dockerfile_port_and_gpu_build_arg() -> None:
    text = (ROOT / "Dockerfile").read_text()
    entry = _entrypoint()
    assert entry[:2] == ["ironlm", "serve"]
    config = server_config_from_args(build_parser(entry[1:]).parse_args(entry[1:]))
    assert re.search(rf"^EXPOSE {config.port}$", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, re.MULTILINE)
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in text
    # Every path the build copies exists in the repository.
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.MULTILINE):
        for src in shlex.split(line)[:-1]:
            assert (ROOT / src).exists(), src
