"""deploy/k8s: every manifest valid against the Kubernetes API schemas (offline, the
`kubernetes-validate` package), and wired the way the stack needs."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from compose.cli import build_parser

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def resources() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                         if p.name != "kustomization.yaml")
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text())]


def by_kind_and_name() -> dict[tuple[str, str], dict]:
    return {(r["kind"], r["metadata"]["name"]): r for r in resources()}


@pytest.mark.parametrize("resource", resources(), ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_valid_against_the_api_schema(resource):
    kubernetes_validate.validate(resource, latest_version(), strict=True)


def test_the_validation_can_fail():
    worker = by_kind_and_name()[("Deployment", "worker")]
    broken = yaml.safe_load(yaml.safe_dump(worker))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, latest_version(), strict=True)
    broken = yaml.safe_load(yaml.safe_dump(worker))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, latest_version(), strict=True)


def _container(resource: dict) -> dict:
    (container,) = resource["spec"]["template"]["spec"]["containers"]
    return container


def _args(container: dict, monkeypatch):
    """The container's command line as our CLI parses it, with its plain environment."""
    for env in container.get("env", []):
        monkeypatch.setenv(env["name"], env.get("value", "from-the-downward-api"))
    return build_parser().parse_args(container["args"])


def test_workers_one_gpu_each_probed_and_reachable(monkeypatch):
    worker = _container(by_kind_and_name()[("Deployment", "worker")])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    # an explicit CPU limit, which the worker's thread count follows (modeling/cpu_threads.py)
    assert worker["resources"]["limits"]["cpu"] == "4" and worker["resources"]["requests"]["cpu"] == "2"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"] == {"port": 50051}, probe  # grpc.health.v1
    env = {e["name"]: e for e in worker["env"]}
    assert env["PAGEDSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    args = _args(worker, monkeypatch)
    assert args.command == "worker" and args.device == "cuda" and args.gpu_memory_utilization == 0.9
    assert args.advertise_host == "from-the-downward-api" and args.redis_url == "redis://redis:6379/0"


def test_one_scheduler_under_a_stable_consumer_name(monkeypatch):
    scheduler = by_kind_and_name()[("StatefulSet", "scheduler")]
    assert scheduler["spec"]["replicas"] == 1
    container = _container(scheduler)
    env = {e["name"]: e for e in container["env"]}
    assert env["PAGEDSERVE_CONSUMER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert _args(container, monkeypatch).command == "scheduler"
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"


def test_the_gateway_service_selects_probed_gateways(monkeypatch):
    found = by_kind_and_name()
    gateway, service = found[("Deployment", "gateway")], found[("Service", "gateway")]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    container = _container(gateway)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    (port,) = container["ports"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert _args(container, monkeypatch).port == port["containerPort"]


def test_services_reach_redis_by_its_service_name():
    found = by_kind_and_name()
    redis_port = found[("Service", "redis")]["spec"]["ports"][0]["port"]
    for kind, name in [("Deployment", "worker"), ("StatefulSet", "scheduler"), ("Deployment", "gateway")]:
        env = {e["name"]: e.get("value") for e in _container(found[(kind, name)])["env"]}
        assert env["PAGEDSERVE_REDIS_URL"] == f"redis://redis:{redis_port}/0"


@pytest.mark.parametrize("name", ["worker", "gateway"])
def test_pods_get_longer_than_their_drain_to_stop(name, monkeypatch):
    """Kubernetes SIGKILLs a pod terminationGracePeriodSeconds after SIGTERM (30 s when
    unset): it must outlast the service's --drain-timeout, or the drain is cut."""
    deployment = by_kind_and_name()[("Deployment", name)]
    args = _args(_container(deployment), monkeypatch)
    drain = args.drain_timeout
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain + 5
