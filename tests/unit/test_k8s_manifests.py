"""deploy/k8s: every manifest against the Kubernetes API schemas (kubernetes-validate, strict:
an unknown or misspelt field fails), and what the schemas cannot say: probes, selectors,
ports, the autoscaler's target, and the two forms' wiring.

Two forms live there: the single-engine form (deploy/k8s/*.yaml: ConfigMap, Deployment,
Service, PodDisruptionBudget, HorizontalPodAutoscaler) and the Ray Serve form
(deploy/k8s/ray/: KubeRay's RayService, the front end that attaches to it, their ConfigMap).
kubernetes-validate has no schema for the RayService custom resource, so its pod templates are
validated as PodTemplates, its serveConfigV2 with Ray Serve's own schema, and the application
it names is built and compared with what ``gemel serve`` would deploy from the same file.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")

from gemel.config import GemelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest schemas kubernetes-validate ships and the newest: every API used here is in both.
VERSIONS = ("1.25", kubernetes_validate.latest_version())
CORE = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def _docs(directory: Path, recursive: bool = False) -> list[tuple[str, dict]]:
    files = sorted(directory.rglob("*.yaml") if recursive else directory.glob("*.yaml"))
    return [(p.relative_to(K8S).as_posix(), d) for p in files for d in yaml.safe_load_all(p.read_text()) if d]


ALL = _docs(K8S, recursive=True)
SINGLE = {d["kind"]: d for _, d in _docs(K8S)}
RAY = {(d["kind"], d["metadata"]["name"]): d for _, d in _docs(K8S / "ray")}
RAYSERVICE = RAY[("RayService", "gemel-ray")]
FRONTEND = RAY[("Deployment", "gemel-frontend")]


def _validate(doc: dict) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in ALL if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pod_templates(rayservice: dict) -> list[tuple[str, dict]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = [("head", cluster["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]
    return out


# -- the schemas ----------------------------------------------------------------------------------------------
def test_the_expected_manifests_are_there():
    kinds = sorted((f, d["kind"]) for f, d in ALL)
    assert kinds == sorted([
        ("configmap.yaml", "ConfigMap"), ("deployment.yaml", "Deployment"), ("hpa.yaml", "HorizontalPodAutoscaler"),
        ("pdb.yaml", "PodDisruptionBudget"), ("service.yaml", "Service"),
        ("ray/configmap.yaml", "ConfigMap"), ("ray/frontend.yaml", "Deployment"), ("ray/frontend.yaml", "Service"),
        ("ray/frontend.yaml", "PodDisruptionBudget"), ("ray/rayservice.yaml", "RayService"),
    ])  # fmt: skip


@pytest.mark.parametrize("doc", [pytest.param(d, id=f"{f}:{d['kind']}/{d['metadata']['name']}") for f, d in ALL if d["kind"] in CORE])
def test_core_kinds_match_the_api_schema(doc):
    _validate(doc)


def test_the_validator_fails_what_it_should():
    """The schemas bite: a misspelt field, a wrong type, an unknown kind."""
    broken = copy.deepcopy(SINGLE["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessprobe"):
        _validate(broken)
    broken = copy.deepcopy(SINGLE["HorizontalPodAutoscaler"])
    broken["spec"]["minReplicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # a custom resource: no built-in schema
        _validate(RAYSERVICE)


@pytest.mark.parametrize("group", [g for g, _ in _pod_templates(RAYSERVICE)])
def test_rayservice_pod_templates_match_the_api_schema(group):
    template = dict(_pod_templates(RAYSERVICE))[group]
    _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"gemel-ray-{group}"}, "template": template})


# -- the single-engine form -----------------------------------------------------------------------------------
def _gemel_container(deployment: dict) -> dict:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gemel"]
    return c


@pytest.mark.parametrize("deployment", [SINGLE["Deployment"], FRONTEND], ids=["gemel", "gemel-frontend"])
def test_gemel_containers_probe_readyz_and_healthz(deployment):
    c = _gemel_container(deployment)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"  # the ConfigMaps turn TLS on


@pytest.mark.parametrize("form", ["single", "ray"])
def test_services_and_disruption_budgets_select_their_deployment(form):
    docs = SINGLE if form == "single" else {k: v for (k, _), v in RAY.items()}
    deployment, service, pdb = docs["Deployment"], docs["Service"], docs["PodDisruptionBudget"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert _selects(service["spec"]["selector"], labels)
    assert _selects(pdb["spec"]["selector"]["matchLabels"], labels)
    named = {p["name"] for p in _gemel_container(deployment)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    # neither form's selectors take the other's pods (both may run in one namespace)
    other = (RAY[("Deployment", "gemel-frontend")] if form == "single" else SINGLE["Deployment"])["spec"]["template"]["metadata"]["labels"]
    assert not _selects(service["spec"]["selector"], other) and not _selects(pdb["spec"]["selector"]["matchLabels"], other)
    for _, template in _pod_templates(RAYSERVICE):
        assert not _selects(service["spec"]["selector"], template["metadata"]["labels"])


def test_the_autoscaler_owns_the_deployments_count():
    hpa, deployment, pdb = SINGLE["HorizontalPodAutoscaler"], SINGLE["Deployment"], SINGLE["PodDisruptionBudget"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"]  # else every `kubectl apply` resets the autoscaler's count
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]  # a drain never blocks
    (cpu,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
    assert cpu["resource"]["name"] == "cpu" and "cpu" in _gemel_container(deployment)["resources"]["requests"]


def test_the_drain_fits_the_grace_period():
    for deployment, configmap in [(SINGLE["Deployment"], SINGLE["ConfigMap"]), (FRONTEND, RAY[("ConfigMap", "gemel-ray-config")])]:
        config = GemelConfig.model_validate(yaml.safe_load(configmap["data"]["gemel.yaml"]))
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.server.drain_timeout_s + 15


# -- the Ray Serve form ---------------------------------------------------------------------------------------
RAY_CONFIG = GemelConfig.model_validate(yaml.safe_load(RAY[("ConfigMap", "gemel-ray-config")]["data"]["gemel.yaml"]))


def _serve_config() -> dict:
    assert RAYSERVICE["apiVersion"] == "ray.io/v1" and RAYSERVICE["kind"] == "RayService"
    return yaml.safe_load(RAYSERVICE["spec"]["serveConfigV2"])


def _mount_path(template: dict, container: dict, configmap: str) -> str | None:
    volumes = {v["name"] for v in template["spec"]["volumes"] if v.get("configMap", {}).get("name") == configmap}
    return next((m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in volumes), None)


def test_serve_config_names_gemels_application():
    serve = _serve_config()
    (app,) = serve["applications"]
    assert app["import_path"] == "gemel.scale.app:build"
    assert app["route_prefix"] is None  # reached through gemel's front end only
    models = [m.id for m in RAY_CONFIG.models]
    assert app["args"]["model"] in models and app["name"] == f"gemel-{app['args']['model']}"


def test_serve_config_matches_ray_serves_schema():
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(_serve_config())
    assert [a.name for a in schema.applications] == [f"gemel-{m.id}" for m in RAY_CONFIG.models]
    with pytest.raises(ValueError):  # and the schema bites
        ServeDeploySchema.model_validate({**_serve_config(), "applications": [{"name": "x"}]})


def test_every_ray_pod_reads_the_builders_config_where_it_says():
    """The builder runs as a Ray task on any node: the file in args.config is on each of them,
    and it is the file the front end reads."""
    (app,) = _serve_config()["applications"]
    config_path = Path(app["args"]["config"])
    for group, template in _pod_templates(RAYSERVICE):
        (ray_container,) = [c for c in template["spec"]["containers"] if c["name"].startswith("ray-")]
        assert ray_container["image"] == _gemel_container(FRONTEND)["image"], group
        assert _mount_path(template, ray_container, "gemel-ray-config") == str(config_path.parent), group
        for probe in ("readinessProbe", "livenessProbe"):  # the image has no wget for KubeRay's default probes
            assert "httpGet" in ray_container[probe], (group, probe)
    front = FRONTEND["spec"]["template"]
    assert _mount_path(front, _gemel_container(FRONTEND), "gemel-ray-config") == str(config_path.parent)
    assert _gemel_container(FRONTEND)["args"] == ["serve", "--config", str(config_path)]


def test_the_front_end_attaches_to_the_rayservices_cluster():
    scale = RAY_CONFIG.scale
    assert scale.enabled and scale.attach
    assert scale.ray_address == f"ray://{RAYSERVICE['metadata']['name']}-head-svc:10001"  # KubeRay's head Service, Ray Client
    head = RAYSERVICE["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # replicas go to the workers
    assert 10001 in {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    for group in RAYSERVICE["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        cpus = float(group["rayStartParams"]["num-cpus"])
        assert cpus >= scale.num_cpus and float(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]) == cpus


def test_the_built_application_is_what_gemel_serve_deploys(tmp_path):
    """serveConfigV2's application, built from the ConfigMap's file, equals the one a front
    end with that file would deploy itself (settings, resources, router, engine)."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    from gemel.api.state import ServerState
    from gemel.scale.app import build

    (app,) = _serve_config()["applications"]
    path = tmp_path / "gemel.yaml"
    path.write_text(RAY[("ConfigMap", "gemel-ray-config")]["data"]["gemel.yaml"])
    built = build({**app["args"], "config": str(path)})._bound_deployment
    pool = ServerState(RAY_CONFIG).models[0].engine
    assert pool.app_name == app["name"]
    own = pool.application()._bound_deployment
    assert built.name == own.name == "engine"
    assert built.init_args == own.init_args and built.init_kwargs == own.init_kwargs
    assert built.ray_actor_options == own.ray_actor_options == {"num_cpus": RAY_CONFIG.scale.num_cpus}
    assert built._deployment_config.model_dump() == own._deployment_config.model_dump()
    auto = built._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas) == (RAY_CONFIG.scale.min_replicas, RAY_CONFIG.scale.max_replicas)
    router = built._deployment_config.request_router_config
    assert router.request_router_kwargs == {"pool": app["name"]}  # the front end's pool answers to this name
    assert built.init_args[0]["num_threads"] == RAY_CONFIG.scale.engine_threads
    with pytest.raises(ValueError, match="no model"):
        build({"config": str(path), "model": "not-in-the-catalogue"})
