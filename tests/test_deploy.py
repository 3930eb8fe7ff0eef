"""The example manifests under deploy/ hold together: every jaxserve command line parses with the
real CLI (flags that exist, values of the right type), ports the flags open are the declared
container ports, probes hit routes the server has on ports that exist, Services select pods that
exist and target their named ports, and a multi-host group's sizes add up. A server listening
beyond its pod has keys (--tenants) and a /metrics token, both files of mounted Secrets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from jaxserve.entrypoints.cli import build_parser
from jaxserve.config import ServerConfig
from jaxserve.entrypoints.engine_flags import distributed_config
from jaxserve.entrypoints.http.app import build_app
from jaxserve.entrypoints.launcher import check_exposure

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))
# What LeaderWorkerSet injects into every pod of a group; the worker index varies per pod.
LWS_ENV = {"LWS_LEADER_ADDRESS": "jaxserve-multihost-0.jaxserve-multihost"}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_templates(doc: dict) -> list[tuple[dict, dict]]:
    """(template, extra env) of every pod a workload creates."""
    if doc["kind"] == "Deployment":
        return [(doc["spec"]["template"], {})]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        size = lwt["size"]
        env = dict(LWS_ENV, LWS_GROUP_SIZE=str(size))
        return [(lwt["leaderTemplate"], dict(env, LWS_WORKER_INDEX="0")),
                (lwt["workerTemplate"], dict(env, LWS_WORKER_INDEX=str(size - 1)))]
    return []


def expand(arg: str, env: dict) -> str:
    def var(m):
        assert m.group(1) in env, f"{arg}: ${m.group(1)} is not set in the pod"
        return env[m.group(1)]
    return re.sub(r"\$\((\w+)\)", var, arg)


def jaxserve_args(container: dict, env: dict):
    command = container["command"]
    assert command[0] == "jaxserve", command
    env = {**{e["name"]: e.get("value", "") for e in container.get("env", [])}, **env}
    return build_parser().parse_args([*command[1:], *(expand(a, env) for a in container["args"])])


def mounts(template: dict, container: dict) -> list[Path]:
    """Where the container mounts Secret volumes (keys and tokens live in Secrets)."""
    secrets = {v["name"] for v in template["spec"].get("volumes", []) if "secret" in v}
    return [Path(m["mountPath"]) for m in container.get("volumeMounts", [])
            if m["name"] in secrets]


ROUTES = {r.resource.canonical for r in build_app(ServerConfig(), "m").router.routes()}


def test_there_are_manifests():
    assert {p.name for p in MANIFESTS} >= {"fleet.yaml", "multihost-lws.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_holds_together(path):
    docs = documents(path)
    pods = [(t, env) for d in docs for t, env in pod_templates(d)]
    assert pods, f"{path.name} runs no pods"
    for template, env in pods:
        for container in template["spec"]["containers"]:
            args = jaxserve_args(container, env)
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            if args.command == "serve" and "http" in ports:
                assert ports["http"] == args.port
                assert args.host == "0.0.0.0", "a pod must listen beyond its loopback"
                # beyond loopback, keys (or the explicit flag, which an example never uses)
                assert args.tenants is not None and not args.allow_unauthenticated
                check_exposure(args.host, args.tenants, args.allow_unauthenticated)
                mounted = mounts(template, container)
                for flag in (args.tenants, args.metrics_token_file):  # files of mounted Secrets
                    assert flag is not None and any(flag.is_relative_to(m) for m in mounted), flag
            if "grpc" in ports:
                assert ports["grpc"] == args.grpc_port
            for probe, path_ in (("readinessProbe", "/ready"), ("livenessProbe", "/health"),
                                 ("startupProbe", "/health")):
                if probe in container:
                    get = container[probe]["httpGet"]
                    assert get["path"] == path_ and get["path"] in ROUTES
                    assert get["port"] in ports, f"{probe} targets an undeclared port"
            annotations = template["metadata"].get("annotations", {})
            if "prometheus.io/port" in annotations:  # a scraper elsewhere: it needs the token
                assert args.metrics_token_file is not None
                assert int(annotations["prometheus.io/port"]) == args.port
                assert annotations["prometheus.io/path"] in ROUTES
            group = distributed_config(args)
            if group is not None:  # a multi-host group: sizes, coordinator and devices add up
                assert group.process_id < group.num_processes == int(env["LWS_GROUP_SIZE"])
                coordinator_port = int(group.coordinator_address.rpartition(":")[2])
                if group.process_id == 0:
                    assert ports.get("coordinator") == coordinator_port
                    assert "readinessProbe" in container
                else:
                    assert not ports and "readinessProbe" not in container  # no HTTP on workers
                gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
                assert args.tensor_parallel_size == gpus * group.num_processes
                assert args.data_parallel_size in (None, 1)
    for service in (d for d in docs if d["kind"] == "Service"):
        selected = [t for t, _ in pods
                    if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for template in selected:
                names = {p["name"] for c in template["spec"]["containers"]
                         for p in c.get("ports", [])}
                assert port["targetPort"] in names, (service["metadata"]["name"], port)


def _exported_metrics() -> set[str]:
    """The metric names a server with --capacity-rates exports for one engine (its real
    collectors over one EngineStats)."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.core.engine import EngineStats
    from jaxserve.telemetry.capacity import CapacityCollector, Rates
    from jaxserve.telemetry.metrics import ServerMetrics

    stats = EngineStats(*[0] * 11, num_new_by_priority={})
    metrics = ServerMetrics(lambda: {"m": [stats]})
    metrics.registry.register(CapacityCollector(lambda: {"m": [stats]}, Rates(1.0, 1.0), 0.2, 3))
    return {f.name for f in text_string_to_metric_families(metrics.render().decode())}


def test_scaled_objects_scale_a_deployment_on_metrics_its_servers_export():
    exported, found = _exported_metrics(), 0
    for path in MANIFESTS:
        docs = documents(path)
        for scaled in (d for d in docs if d["kind"] == "ScaledObject"):
            found += 1
            spec = scaled["spec"]
            target, = [d for d in docs if d["kind"] == "Deployment"
                       and d["metadata"]["name"] == spec["scaleTargetRef"]["name"]]
            container, = target["spec"]["template"]["spec"]["containers"]
            args = jaxserve_args(container, {})
            assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
            assert spec["minReplicaCount"] >= args.capacity_zones  # a replica in every zone
            queries = []
            for trigger in spec["triggers"]:
                assert trigger["type"] == "prometheus" and float(
                    trigger["metadata"]["threshold"]) > 0
                query = trigger["metadata"]["query"]
                names = re.findall(r"jaxserve:\w+", query)
                assert names and set(names) <= exported, (query, exported)
                assert set(re.findall(r'model_name="([^"]+)"', query)) == {args.model}
                queries.append(query)
            if any("jaxserve:desired_replicas" in q for q in queries):
                assert args.capacity_rates is not None  # the gauge exists only with it
    assert found, "no ScaledObject example under deploy/"
