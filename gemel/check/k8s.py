"""Kubernetes manifests (``--k8s DIR``): loading them and the deployment rules over them.

Every ``*.yaml``, ``*.yml`` and ``*.json`` under the directory is read (multi-document files
and ``kind: List`` too). Workloads are Deployments, StatefulSets, DaemonSets and Pods; a
container runs gemel when its image or command names gemel (all containers when none does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemel.check.rules import Inputs, Result, failed, passed, rule

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Pod")
CONFIG_KEY = "gemel.yaml"


@dataclass(frozen=True)
class K8sObject:
    kind: str
    name: str
    namespace: str
    doc: dict
    file: str

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class Workload:
    obj: K8sObject
    pod: dict  # the pod spec
    labels: dict

    @property
    def containers(self) -> list[dict]:
        return list(self.pod.get("containers") or [])

    @property
    def all_containers(self) -> list[dict]:
        return self.containers + list(self.pod.get("initContainers") or [])

    def gemel_containers(self) -> list[dict]:
        named = [c for c in self.containers if "gemel" in _container_text(c)]
        return named or self.containers


def _container_text(c: dict) -> str:
    return " ".join([str(c.get("image", "")), *map(str, c.get("command") or []), *map(str, c.get("args") or [])]).lower()


@dataclass
class Manifests:
    directory: str
    objects: list[K8sObject] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def of_kind(self, *kinds: str) -> list[K8sObject]:
        return [o for o in self.objects if o.kind in kinds]

    def workloads(self) -> list[Workload]:
        out = []
        for o in self.of_kind(*WORKLOAD_KINDS):
            spec = o.doc.get("spec") or {}
            if o.kind == "Pod":
                out.append(Workload(o, spec, (o.doc.get("metadata") or {}).get("labels") or {}))
            else:
                template = spec.get("template") or {}
                out.append(Workload(o, template.get("spec") or {}, (template.get("metadata") or {}).get("labels") or {}))
        return out

    def gemel_config(self) -> tuple[str, str] | None:
        """The text of a ConfigMap's ``gemel.yaml`` and where it came from, if one is there."""
        for o in self.of_kind("ConfigMap"):
            data = o.doc.get("data") or {}
            if CONFIG_KEY in data:
                return data[CONFIG_KEY], f"{o.ref} key {CONFIG_KEY} ({o.file})"
        return None

    def memory_limit_mb(self) -> tuple[float, str] | None:
        """The smallest memory limit of a gemel container, which the engines must fit in."""
        best = None
        for w in self.workloads():
            for c in w.gemel_containers():
                text = ((c.get("resources") or {}).get("limits") or {}).get("memory")
                value = parse_quantity(text) if text is not None else None
                if value is not None and (best is None or value / 2**20 < best[0]):
                    best = (value / 2**20, f"memory limit {text} of {w.obj.ref} container {c.get('name')}")
        return best


def load_manifests(directory: str | Path) -> Manifests:
    import json

    import yaml

    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory")
    m = Manifests(str(directory))
    files = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml", ".json") and p.is_file())
    for path in files:
        try:
            text = path.read_text()
            docs = [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))
        except (OSError, ValueError, yaml.YAMLError) as e:
            m.errors.append(f"{path}: {e}")
            continue
        for doc in _flatten(docs):
            meta = doc.get("metadata") or {}
            m.objects.append(K8sObject(str(doc["kind"]), str(meta.get("name", "?")), str(meta.get("namespace", "default")),
                                       doc, str(path)))  # fmt: skip
    return m


def _flatten(docs: list) -> Iterator[dict]:
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc:
            continue  # empty documents, and JSON files that are not manifests (a seccomp profile)
        if doc["kind"] == "List":
            yield from _flatten(doc.get("items") or [])
        else:
            yield doc


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}  # fmt: skip


def parse_quantity(text: Any) -> float | None:
    """A Kubernetes quantity ("6Gi", "500m", "2", "1e3") as a number, None when malformed."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2) not in _SUFFIX:
        return None
    return float(m.group(1)) * _SUFFIX[m.group(2)]


# -- rules ----------------------------------------------------------------------------------


def _no_workloads(inp: Inputs) -> Result | None:
    if not inp.manifests.workloads():
        return failed(f"no Deployment, StatefulSet, DaemonSet or Pod in {inp.manifests.directory}")
    return None


def _each_container(inp: Inputs, problem: Callable[[Workload, dict], str | None], ok: str, init: bool = True) -> Result:
    none = _no_workloads(inp)
    if none:
        return none
    problems, count = [], 0
    for w in inp.manifests.workloads():
        for c in w.all_containers if init else w.containers:
            count += 1
            p = problem(w, c)
            if p:
                problems.append(f"{w.obj.ref} container {c.get('name')}: {p}")
    return failed("; ".join(problems)) if problems else passed(f"{count} container(s): {ok}")


def _each_workload(inp: Inputs, problem: Callable[[Workload], str | None], ok: str) -> Result:
    none = _no_workloads(inp)
    if none:
        return none
    problems = [f"{w.obj.ref}: {p}" for w in inp.manifests.workloads() if (p := problem(w))]
    return failed("; ".join(problems)) if problems else passed(f"{len(inp.manifests.workloads())} workload(s): {ok}")


def _sc(w: Workload, c: dict, key: str) -> Any:
    """A security setting as it applies to a container: its own, else the pod's."""
    own = (c.get("securityContext") or {}).get(key)
    return own if own is not None else (w.pod.get("securityContext") or {}).get(key)


@rule("DEP001", "deployment", "high", "k8s", "Containers run as a non-root user",
      "Root in the container is root on the node's files the container can reach, and one kernel bug from root on the node.",
      "Set `securityContext.runAsNonRoot: true` and a non-zero `runAsUser` (the image's user is 10001).")  # fmt: skip
def _dep_non_root(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        user = _sc(w, c, "runAsUser")
        if user == 0:
            return "runAsUser=0"
        if _sc(w, c, "runAsNonRoot") is not True and user is None:
            return "neither runAsNonRoot: true nor a runAsUser"
        return None

    return _each_container(inp, problem, "non-root")


@rule("DEP002", "deployment", "high", "k8s", "Privilege escalation is off (`allowPrivilegeEscalation: false`)",
      "Without it a setuid binary or file capability in the image can raise the process's privileges.",
      "Set `securityContext.allowPrivilegeEscalation: false` on every container.")  # fmt: skip
def _dep_escalation(inp: Inputs) -> Result:
    return _each_container(inp, lambda w, c: None if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is False
                           else "allowPrivilegeEscalation is not false", "allowPrivilegeEscalation=false")  # fmt: skip


@rule("DEP003", "deployment", "high", "k8s", "No privileged containers and no host namespaces",
      "`privileged`, `hostNetwork`, `hostPID` and `hostIPC` hand the container the node itself.",
      "Remove `privileged: true` and the `host*` settings; gemel needs none of them.")  # fmt: skip
def _dep_privileged(inp: Inputs) -> Result:
    def problem(w: Workload) -> str | None:
        bad = [k for k in ("hostNetwork", "hostPID", "hostIPC") if w.pod.get(k)]
        bad += [f"container {c.get('name')} privileged" for c in w.all_containers if (c.get("securityContext") or {}).get("privileged")]
        return ", ".join(bad) or None

    return _each_workload(inp, problem, "unprivileged, no host namespaces")


@rule("DEP004", "deployment", "medium", "k8s", "The root filesystem is read-only",
      "A writable image lets an intruder change gemel's code or its prebuilt kernels for the next request.",
      "Set `securityContext.readOnlyRootFilesystem: true` and mount emptyDir volumes where gemel writes (/tmp and the cache directory).")  # fmt: skip
def _dep_read_only(inp: Inputs) -> Result:
    return _each_container(inp, lambda w, c: None if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is True
                           else "readOnlyRootFilesystem is not true", "read-only root filesystem")  # fmt: skip


@rule("DEP005", "deployment", "medium", "k8s", "A seccomp profile applies (RuntimeDefault or Localhost)",
      "Unconfined containers may call every system call of the node's kernel, which widens what a compromised process can reach.",
      "Set `securityContext.seccompProfile.type: RuntimeDefault`, or `Localhost` with deploy/seccomp/gemel-engine.json installed on the nodes.")  # fmt: skip
def _dep_seccomp(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        kind = (_sc(w, c, "seccompProfile") or {}).get("type")
        return None if kind in ("RuntimeDefault", "Localhost") else f"seccompProfile.type={kind}"

    return _each_container(inp, problem, "seccomp RuntimeDefault or Localhost")


@rule("DEP006", "deployment", "medium", "k8s", "All Linux capabilities are dropped",
      "The runtime's default capabilities (raw sockets, chown, setuid...) are unused by gemel and useful to an attacker.",
      "Set `securityContext.capabilities.drop: [ALL]` and add nothing back (NET_BIND_SERVICE only for ports below 1024).")  # fmt: skip
def _dep_caps(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        caps = (c.get("securityContext") or {}).get("capabilities") or {}
        if "ALL" not in [str(x).upper() for x in caps.get("drop") or []]:
            return "capabilities.drop lacks ALL"
        extra = [a for a in caps.get("add") or [] if str(a).upper() not in ("NET_BIND_SERVICE",)]
        return f"capabilities.add {extra}" if extra else None

    return _each_container(inp, problem, "capabilities drop ALL")


@rule("DEP007", "deployment", "medium", "k8s", "Resources requests equal limits (Guaranteed QoS)",
      "An engine's latency depends on whole cores and its memory on a fixed budget; burstable pods are throttled and evicted first.",
      "Give every container `resources.requests` equal to `resources.limits` for both cpu and memory.")  # fmt: skip
def _dep_qos(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        bad = []
        for r in ("cpu", "memory"):
            if r not in limits:
                bad.append(f"no {r} limit")
            elif r in requests and parse_quantity(requests[r]) != parse_quantity(limits[r]):
                bad.append(f"{r} request {requests[r]} != limit {limits[r]}")
        return ", ".join(bad) or None

    return _each_container(inp, problem, "requests = limits for cpu and memory")


def _probe_path(probe: dict | None) -> str | None:
    return ((probe or {}).get("httpGet") or {}).get("path")


@rule("DEP008", "deployment", "medium", "k8s", "Liveness probes /healthz, readiness probes /readyz",
      "/readyz is red while models load, when an engine is silent and while draining; a load balancer that only sees /healthz sends traffic to a server that cannot answer it.",
      "Add `livenessProbe.httpGet.path: /healthz` and `readinessProbe.httpGet.path: /readyz` (scheme HTTPS with TLS) to the gemel container.")  # fmt: skip
def _dep_probes(inp: Inputs) -> Result:
    none = _no_workloads(inp)
    if none:
        return none
    problems, count = [], 0
    for w in inp.manifests.workloads():
        for c in w.gemel_containers():
            count += 1
            live, ready = _probe_path(c.get("livenessProbe")), _probe_path(c.get("readinessProbe"))
            bad = []
            if live != "/healthz":
                bad.append(f"livenessProbe path {live}")
            if ready != "/readyz":
                bad.append(f"readinessProbe path {ready}")
            if bad:
                problems.append(f"{w.obj.ref} container {c.get('name')}: {', '.join(bad)}")
    return failed("; ".join(problems)) if problems else passed(f"{count} gemel container(s) probe /healthz and /readyz")


def _selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels") or {}
    if not match and not selector.get("matchExpressions"):
        return False
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):  # fmt: skip
            return False
    return True


@rule("DEP009", "deployment", "medium", "k8s", "A PodDisruptionBudget covers each Deployment and StatefulSet",
      "Node drains and upgrades may otherwise evict every replica at once, and model loading makes the way back slow.",
      "Add a PodDisruptionBudget (e.g. `minAvailable: 1`) whose selector matches the pods' labels.")  # fmt: skip
def _dep_pdb(inp: Inputs) -> Result:
    controllers = [w for w in inp.manifests.workloads() if w.obj.kind in ("Deployment", "StatefulSet")]
    if not controllers:
        return failed(f"no Deployment or StatefulSet in {inp.manifests.directory}")
    pdbs = inp.manifests.of_kind("PodDisruptionBudget")
    uncovered, covered = [], []
    for w in controllers:
        match = [p for p in pdbs if p.namespace == w.obj.namespace and _selects((p.doc.get("spec") or {}).get("selector") or {}, w.labels)]
        (covered if match else uncovered).append(f"{w.obj.ref}" + (f" by {match[0].ref}" if match else ""))
    return failed(f"no PodDisruptionBudget selects {', '.join(uncovered)}") if uncovered else passed(", ".join(covered))


SHUTDOWN_MARGIN_S = 15  # after the drain: uvicorn's grace, the gRPC stop and the engines' exit


@rule("DEP010", "deployment", "medium", "k8s", "terminationGracePeriodSeconds outlasts the drain",
      "On SIGTERM gemel drains running requests for `server.drain_timeout_s` and then needs up to 15 s to stop; a shorter grace period SIGKILLs it mid-answer.",
      "Set `terminationGracePeriodSeconds` above `server.drain_timeout_s` + 15 (default drain 30 s: more than 45).")  # fmt: skip
def _dep_grace(inp: Inputs) -> Result:
    drain = float(getattr(inp.config.server, "drain_timeout_s", 30.0)) if inp.config is not None else 30.0
    need = drain + SHUTDOWN_MARGIN_S
    src = "server.drain_timeout_s" if inp.config is not None else "the default drain_timeout_s"

    def problem(w: Workload) -> str | None:
        grace = w.pod.get("terminationGracePeriodSeconds", 30)
        return None if grace > need else f"terminationGracePeriodSeconds={grace} <= {src} {drain:g} + {SHUTDOWN_MARGIN_S}"

    return _each_workload(inp, problem, f"grace period above {src} {drain:g} + {SHUTDOWN_MARGIN_S}")


@rule("DEP011", "deployment", "low", "k8s", "Images are pinned (a version tag or digest, not latest)",
      "A moving tag changes what runs on the next pod restart without a change to the manifests.",
      "Reference images by version tag (gemel:0.1.0) or digest (@sha256:...).")  # fmt: skip
def _dep_image(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        image = str(c.get("image", ""))
        if "@sha256:" in image:
            return None
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        return None if tag and tag != "latest" else f"image {image or '(none)'} is not pinned"

    return _each_container(inp, problem, "pinned images")


@rule("DEP012", "deployment", "low", "k8s", "No service account token is mounted",
      "gemel never calls the Kubernetes API; a mounted token only helps whoever takes over the container.",
      "Set `automountServiceAccountToken: false` in the pod spec.")  # fmt: skip
def _dep_token(inp: Inputs) -> Result:
    return _each_workload(inp, lambda w: None if w.pod.get("automountServiceAccountToken") is False
                          else "automountServiceAccountToken is not false", "no service account token")  # fmt: skip


@rule("DEP013", "deployment", "high", "k8s", "Fault injection is not enabled ($GEMEL_FAULT_INJECTION)",
      "$GEMEL_FAULT_INJECTION=1 honours `engine.fault_injection`, which crashes or hangs engines on purpose (tests only).",
      "Remove GEMEL_FAULT_INJECTION from the containers' env.")  # fmt: skip
def _dep_fault_env(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        env = {e.get("name"): e.get("value") for e in c.get("env") or []}
        return "GEMEL_FAULT_INJECTION is set" if env.get("GEMEL_FAULT_INJECTION") not in (None, "", "0") else None

    return _each_container(inp, problem, "no fault injection")


@rule("DEP014", "deployment", "low", "k8s", "With a read-only root, /tmp is a writable volume",
      "Python, PyTorch and the engine processes write temporary files; on a read-only root without a /tmp volume they fail at start-up.",
      "Mount an `emptyDir` at /tmp (and one for the cache directory, $XDG_CACHE_HOME).")  # fmt: skip
def _dep_tmp(inp: Inputs) -> Result:
    def problem(w: Workload, c: dict) -> str | None:
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
            return None
        mounts = {m.get("mountPath", "").rstrip("/") for m in c.get("volumeMounts") or []}
        return None if "/tmp" in mounts else "readOnlyRootFilesystem without a volume at /tmp"

    return _each_container(inp, problem, "/tmp writable where the root is read-only", init=False)
