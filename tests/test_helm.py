"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk binds Helm's Go SDK).

Every scenario in helm/tool-proxy/ci/ is linted in strict mode and rendered; the tests parse
the manifests and check what an operator relies on: the containers, ports and probes, the
security context, the config checksum, the store wiring, and the refusals.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from proxy.config import parse_config
from proxy.errors import ConfigError

CHART = Path(__file__).resolve().parent.parent / "helm" / "tool-proxy"
SCENARIOS = {p.name.removesuffix("-values.yaml"): p for p in sorted(CHART.glob("ci/*-values.yaml"))}
RELEASE = "rel"
NAMESPACE = "tools"
# helm lint severities: 1 info, 2 warning, 3 error.
WARNING = 2

Manifest = dict[str, Any]
# The store URLs the scenarios' Secrets would hold (as their comments say): the proxy reads
# the rendered config.yaml with one of them in TOOL_PROXY_STORE_URL.
SECRET_URLS = {
    "redis-external": "redis://:secret@redis.db.svc:6379/0",
    "redis-sentinel": "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379/tool-proxy",
    "redis-cluster": "redis+cluster://redis-cluster-0.redis:6379,redis-cluster-1.redis:6379",
    "postgresql": "postgresql://tool_proxy@postgres.db.svc:5432/tool_proxy?pool_max=10",
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def scenario(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(SCENARIOS[name].read_text())
    return values


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every manifest the chart renders for ``values`` (NOTES.txt left out), parsed."""
    rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs: list[Manifest] = []
    for path, text in sorted(rendered.items()):
        if not path.endswith("NOTES.txt"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def find(docs: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def proxy_deployment(docs: list[Manifest]) -> Manifest:
    return one(docs, "Deployment", f"{RELEASE}-tool-proxy")


def container(pod_spec: dict[str, Any], name: str = "tool-proxy") -> dict[str, Any]:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return dict(found)


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def config_text(docs: list[Manifest]) -> str:
    text: str = one(docs, "ConfigMap", f"{RELEASE}-tool-proxy-config")["data"]["config.yaml"]
    return text


def render_error(chart: helm.Chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(caught.value)


# -- lint --------------------------------------------------------------------------------


def test_every_scenario_of_the_issue_has_a_values_file() -> None:
    assert set(SCENARIOS) == {
        *("standalone", "sidecar", "redis-external", "hpa"),
        *("redis-sentinel", "redis-cluster", "postgresql"),
    }


@pytest.mark.parametrize("name", ["default", *SCENARIOS])
def test_lint_is_clean_in_strict_mode(name: str) -> None:
    values = None if name == "default" else scenario(name)
    report = helm.lint(CHART, values, strict=True)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= WARNING] == []


def test_strict_lint_renders_the_values_and_reports_what_it_finds() -> None:
    # Helm's lint mode only logs `fail` (render catches the chart's own refusals, below);
    # an invalid object name is something lint itself rejects.
    report = helm.lint(CHART, {"fullnameOverride": "Not_A_Name"}, strict=True)
    assert any('"Not_A_Name"' in e and "naming requirements" in e for e in report["errors"])


# -- every scenario ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_renders_a_config_the_proxy_accepts(chart: helm.Chart, name: str) -> None:
    values = scenario(name)
    docs = render(chart, values)
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"]
        assert doc["metadata"]["namespace"] == NAMESPACE
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    env = {"TOOL_PROXY_STORE_URL": SECRET_URLS[name]} if name in SECRET_URLS else {}
    config = parse_config(yaml.safe_load(config_text(docs)), env=env)
    assert [r.name for r in config.routes] == [r["name"] for r in values["config"]["routes"]]


# -- standalone --------------------------------------------------------------------------


def test_standalone_deployment_service_probes_and_security(chart: helm.Chart) -> None:
    docs = render(chart, scenario("standalone"))
    deployment = proxy_deployment(docs)
    pod = deployment["spec"]["template"]
    proxy = container(pod["spec"])

    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    expected_args = ["--host", "0.0.0.0", "--port", "8080", "--workers", "1", "--log-level"]
    assert proxy["args"][:-1] == [*expected_args, "info", "--graceful-timeout"]
    grace_period = pod["spec"]["terminationGracePeriodSeconds"]
    assert int(proxy["args"][-1]) == grace_period - 5 - 15  # done before SIGKILL
    assert proxy["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/_proxy/healthz", "port": 8080}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/_proxy/readyz", "port": 8080}
    assert proxy["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]

    service = one(docs, "Service", f"{RELEASE}-tool-proxy")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert_hardened(proxy)


def assert_hardened(proxy: dict[str, Any]) -> None:
    security = proxy["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m["name"] for m in proxy["volumeMounts"]}
    assert mounts["/tmp"] == "tool-proxy-tmp"  # the only writable paths are volumes
    assert mounts["/etc/tool-proxy"] == "tool-proxy-config"
    assert env(proxy)["TOOL_PROXY_CONFIG"] == "/etc/tool-proxy/config.yaml"


def test_standalone_sqlite_lives_on_the_claim(chart: helm.Chart) -> None:
    docs = render(chart, scenario("standalone"))
    pod_spec = proxy_deployment(docs)["spec"]["template"]["spec"]
    proxy = container(pod_spec)
    claim = one(docs, "PersistentVolumeClaim", f"{RELEASE}-tool-proxy-state")
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert (
        volumes["tool-proxy-state"]["persistentVolumeClaim"]["claimName"]
        == claim["metadata"]["name"]
    )
    assert {"name": "tool-proxy-state", "mountPath": "/var/lib/tool-proxy"} in proxy["volumeMounts"]
    assert env(proxy)["TOOL_PROXY_STORE_URL"] == "sqlite:///var/lib/tool-proxy/state.db"


def test_standalone_mounts_credentials_from_existing_secrets(chart: helm.Chart) -> None:
    docs = render(chart, scenario("standalone"))
    pod_spec = proxy_deployment(docs)["spec"]["template"]["spec"]
    proxy = container(pod_spec)
    assert proxy["envFrom"] == [{"secretRef": {"name": "tool-proxy-object-store"}}]
    assert env(proxy)["TOOL_PROXY_CLIENT_SECRET"] == {
        "secretKeyRef": {"name": "tool-proxy-oauth", "key": "client-secret"}
    }
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["tool-proxy-secret-0"]["secret"] == {
        "secretName": "tool-proxy-oauth",
        "items": [{"key": "client-secret", "path": "client-secret"}],
        "defaultMode": 0o440,
    }
    assert {
        "name": "tool-proxy-secret-0",
        "mountPath": "/etc/tool-proxy/secrets/oauth",
        "readOnly": True,
    } in proxy["volumeMounts"]
    assert find(docs, "Secret") == []  # the chart never holds secret values


def checksum(docs: list[Manifest]) -> str:
    annotations = proxy_deployment(docs)["spec"]["template"]["metadata"]["annotations"]
    value: str = annotations["checksum/tool-proxy-config"]
    return value


def test_config_checksum_is_the_sha256_of_the_configmap(chart: helm.Chart) -> None:
    values = scenario("standalone")
    docs = render(chart, values)
    assert checksum(docs) == hashlib.sha256(config_text(docs).encode()).hexdigest()

    values["config"]["routes"][0]["timeout"] = "6m"
    changed = render(chart, values)
    assert checksum(changed) != checksum(docs)

    unrelated = render(chart, {**scenario("standalone"), "resources": {"limits": {"cpu": "1"}}})
    assert checksum(unrelated) == checksum(docs)


def test_existing_configmap_is_mounted_without_a_checksum(chart: helm.Chart) -> None:
    docs = render(
        chart,
        {"existingConfigMap": {"name": "my-routes", "key": "proxy.yaml"}, "config": None},
    )
    assert find(docs, "ConfigMap") == []
    pod = proxy_deployment(docs)["spec"]["template"]
    assert "checksum/tool-proxy-config" not in (pod["metadata"]["annotations"] or {})
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tool-proxy-config"]["configMap"] == {
        "name": "my-routes",
        "items": [{"key": "proxy.yaml", "path": "config.yaml"}],
    }
    # the routes are unknown: maxRouteTimeoutSeconds (30) + 5 s preStop + 30 s
    assert pod["spec"]["terminationGracePeriodSeconds"] == 65


# -- graceful shutdown -------------------------------------------------------------------


def grace(chart: helm.Chart, values: dict[str, Any]) -> int:
    seconds: int = proxy_deployment(render(chart, values))["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    return seconds


def routes(*timeouts: Any) -> dict[str, Any]:
    return {
        "config": {
            "routes": [
                {"name": f"r{i}", "path_prefix": f"/r{i}", "upstream": "http://t:1", "timeout": t}
                for i, t in enumerate(timeouts)
            ]
        }
    }


@pytest.mark.parametrize(
    ("timeouts", "longest"),
    [
        (["30s"], 30),
        (["250ms", 90, "2m"], 120),
        ([12.5, "5s"], 13),
        (["1h", "10s"], 3600),
    ],
)
def test_grace_period_covers_the_longest_route_timeout(
    chart: helm.Chart, timeouts: list[Any], longest: int
) -> None:
    assert grace(chart, routes(*timeouts)) == 5 + longest + 30
    proxy = container(
        proxy_deployment(render(chart, routes(*timeouts)))["spec"]["template"]["spec"]
    )
    graceful = proxy["args"][proxy["args"].index("--graceful-timeout") + 1]
    assert graceful == str(longest + 15)  # done before the kubelet's SIGKILL


def test_grace_period_defaults_route_timeout_and_takes_overrides(chart: helm.Chart) -> None:
    no_timeout = {
        "config": {"routes": [{"name": "a", "path_prefix": "/a", "upstream": "http://a"}]}
    }
    assert grace(chart, no_timeout) == 5 + 30 + 30  # the proxy's default timeout is 30 s
    assert grace(chart, {**routes("2m"), "shutdownDelaySeconds": 0}) == 150
    assert grace(chart, {**routes("2m"), "terminationGracePeriodSeconds": 600}) == 600
    no_hook = container(
        proxy_deployment(render(chart, {"shutdownDelaySeconds": 0}))["spec"]["template"]["spec"]
    )
    assert "lifecycle" not in no_hook


def test_a_timeout_that_is_not_a_duration_fails_the_render(chart: helm.Chart) -> None:
    assert 'timeout "soon" is not a duration' in render_error(chart, routes("soon"))


# -- stores and replicas -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "pods"),
    [
        ({"replicaCount": 2}, 2),
        ({"autoscaling": {"enabled": True, "maxReplicas": 4}}, 4),
        ({"mode": "sidecar", "replicaCount": 3}, 3),
        ({"replicaCount": 2, "store": {"type": "memory"}}, 2),
    ],
)
def test_a_per_pod_store_with_several_pods_is_refused(
    chart: helm.Chart, values: dict[str, Any], pods: int
) -> None:
    message = render_error(chart, values)
    assert "keeps state inside one pod" in message
    assert f"up to {pods} pods" in message
    assert "store.type=redis" in message


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"store": {"type": "redis"}}, "set store.redis.existingSecret"),
        ({"redis": {"enabled": True}}, "set store.type=redis as well"),
        (
            {
                "store": {"type": "redis", "redis": {"existingSecret": "s"}},
                "redis": {"enabled": True},
            },
            "pick the external Redis or the in-chart one",
        ),
        (
            {"config": {"store": {"url": "memory://"}}},
            "config.store: set the store with store.type",
        ),
        ({"config": {"routes": []}}, "at least one route is required"),
        ({"mode": "daemonset"}, 'mode: "daemonset" is not one of'),
        (
            {
                "store": {"type": "redis", "redis": {"existingSecret": "s"}},
                "persistence": {"enabled": True},
            },
            "persistence.enabled=true only makes sense with store.type=sqlite",
        ),
    ],
)
def test_values_that_cannot_work_fail_with_a_message(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    assert message in render_error(chart, values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"store": {"type": "postgresql"}},
            "store.type=postgresql: set store.postgresql.existingSecret",
        ),
        (
            {"store": {"durability": {"replicas": 1}}},
            "store.durability: only for store.type=redis (WAIT for Redis replicas), not sqlite",
        ),
        (
            {
                "store": {
                    "type": "postgresql",
                    "postgresql": {"existingSecret": "pg"},
                    "durability": {"replicas": 1},
                }
            },
            "not postgresql; PostgreSQL has synchronous_commit and synchronous_standby_names",
        ),
        (
            {
                "store": {"type": "redis", "durability": {"replicas": 1}},
                "redis": {"enabled": True},
            },
            "store.durability: the in-chart Redis has no replicas to wait for",
        ),
        ({"store": {"type": "mysql"}}, "is not one of sqlite, redis, postgresql, memory"),
    ],
)
def test_stores_that_cannot_work_fail_with_a_message(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    assert message in render_error(chart, values)


@pytest.mark.parametrize("name", ["redis-sentinel", "redis-cluster"])
def test_redis_with_replicas_waits_for_them(chart: helm.Chart, name: str) -> None:
    values = scenario(name)
    docs = render(chart, values)
    proxy = container(proxy_deployment(docs)["spec"]["template"]["spec"])
    secret = values["store"]["redis"]["existingSecret"]
    assert env(proxy)["TOOL_PROXY_STORE_URL"] == {"secretKeyRef": {"name": secret, "key": "url"}}
    rendered = yaml.safe_load(config_text(docs))
    assert rendered["store"] == {"durability": values["store"]["durability"]}
    env_ = {"TOOL_PROXY_STORE_URL": SECRET_URLS[name]}
    durability = parse_config(rendered, env=env_).store.durable()
    assert durability is not None and durability.replicas == 1
    # the same file without a Redis URL: refused, naming the field
    with pytest.raises(ConfigError, match=r"store\.durability: only for Redis stores"):
        parse_config(rendered, env={})


def test_postgresql_takes_the_url_from_its_secret_and_rolls_without_downtime(
    chart: helm.Chart,
) -> None:
    docs = render(chart, scenario("postgresql"))
    deployment = proxy_deployment(docs)
    proxy = container(deployment["spec"]["template"]["spec"])
    assert env(proxy)["TOOL_PROXY_STORE_URL"] == {
        "secretKeyRef": {"name": "tool-proxy-postgres", "key": "url"}
    }
    assert env(proxy)["PGPASSWORD"] == {
        "secretKeyRef": {"name": "tool-proxy-postgres", "key": "password"}
    }
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "store" not in yaml.safe_load(config_text(docs))
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    assert mounts["tool-proxy-state"] == "/var/lib/tool-proxy"  # the journal


def test_redis_external_takes_the_url_from_the_secret(chart: helm.Chart) -> None:
    docs = render(chart, scenario("redis-external"))
    deployment = proxy_deployment(docs)
    pod_spec = deployment["spec"]["template"]["spec"]
    proxy = container(pod_spec)
    assert env(proxy)["TOOL_PROXY_STORE_URL"] == {
        "secretKeyRef": {"name": "tool-proxy-redis", "key": "url"}
    }
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert proxy["args"][proxy["args"].index("--workers") + 1] == "2"
    (state,) = [v for v in pod_spec["volumes"] if v["name"] == "tool-proxy-state"]
    assert "emptyDir" in state  # the journal's state_dir: the root file system is read-only
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    assert mounts["tool-proxy-state"] == "/var/lib/tool-proxy"
    assert find(docs, "Deployment", f"{RELEASE}-tool-proxy-redis") == []
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    (spread,) = pod_spec["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pod_spec["terminationGracePeriodSeconds"] == 5 + 45 + 30


def test_hpa_scales_the_deployment_on_the_in_chart_redis(chart: helm.Chart) -> None:
    docs = render(chart, scenario("hpa"))
    deployment = proxy_deployment(docs)
    assert "replicas" not in deployment["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    targets = {m["resource"]["name"]: m["resource"]["target"] for m in hpa["spec"]["metrics"]}
    assert targets["cpu"]["averageUtilization"] == 60
    assert targets["memory"]["averageUtilization"] == 80

    redis_service = one(docs, "Service", f"{RELEASE}-tool-proxy-redis")
    proxy = container(deployment["spec"]["template"]["spec"])
    assert env(proxy)["TOOL_PROXY_STORE_URL"] == f"redis://{RELEASE}-tool-proxy-redis:6379/0"
    redis = one(docs, "Deployment", f"{RELEASE}-tool-proxy-redis")
    redis_args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert redis_args[redis_args.index("--maxmemory-policy") + 1] == "noeviction"
    # the proxy's Service never selects the Redis pods, and Redis's selects only them
    proxy_service = one(docs, "Service", f"{RELEASE}-tool-proxy")
    redis_pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert not proxy_service["spec"]["selector"].items() <= redis_pod_labels.items()
    assert redis_service["spec"]["selector"].items() <= redis_pod_labels.items()

    monitor = one(docs, "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= proxy_service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


# -- sidecar -----------------------------------------------------------------------------


def test_sidecar_mode_renders_no_workload_of_its_own(chart: helm.Chart) -> None:
    docs = render(chart, scenario("sidecar"))
    assert sorted(d["kind"] for d in docs) == ["ConfigMap"]
    notes = chart.render(scenario("sidecar"), name=RELEASE, namespace=NAMESPACE)[
        "tool-proxy/templates/NOTES.txt"
    ]
    assert "- name: tool-proxy" in notes and "containerPort: 8081" in notes


PARENT_POD = """\
{{- $proxy := .Subcharts.toolProxy }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: my-tool
spec:
  replicas: 1
  selector:
    matchLabels: {app: my-tool}
  template:
    metadata:
      labels: {app: my-tool}
      annotations:
        {{- include "tool-proxy.sidecar.podAnnotations" $proxy | nindent 8 }}
    spec:
      terminationGracePeriodSeconds: {{ include "tool-proxy.sidecar.gracePeriodSeconds" $proxy }}
      containers:
        - name: my-tool
          image: my-tool:1.0
          ports: [{name: http, containerPort: 9000}]
        {{- include "tool-proxy.sidecar.container" $proxy | nindent 8 }}
      volumes:
        - name: scratch
          emptyDir: {}
        {{- include "tool-proxy.sidecar.volumes" $proxy | nindent 8 }}
"""


@pytest.fixture
def parent_chart(tmp_path: Path) -> Path:
    """A user's chart with tool-proxy as a dependency (alias toolProxy), as the README shows."""
    parent = tmp_path / "my-tool"
    shutil.copytree(CHART, parent / "charts" / "tool-proxy")
    (parent / "templates").mkdir()
    (parent / "templates" / "deployment.yaml").write_text(PARENT_POD)
    (parent / "Chart.yaml").write_text(
        "apiVersion: v2\nname: my-tool\nversion: 1.0.0\n"
        "dependencies:\n  - name: tool-proxy\n    version: 0.1.0\n    alias: toolProxy\n"
    )
    (parent / "values.yaml").write_text(yaml.safe_dump({"toolProxy": scenario("sidecar")}))
    return parent


def test_sidecar_snippets_in_a_users_pod(parent_chart: Path) -> None:
    with helm.Chart.load(parent_chart) as loaded:
        docs = render(loaded)
    pod = one(docs, "Deployment", "my-tool")["spec"]["template"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["my-tool", "tool-proxy"]
    proxy = container(pod["spec"])
    assert proxy["ports"] == [{"name": "tool-proxy", "containerPort": 8081, "protocol": "TCP"}]
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/_proxy/healthz", "port": 8081}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/_proxy/readyz", "port": 8081}
    assert_hardened(proxy)
    assert env(proxy)["TOOL_PROXY_STORE_URL"] == "sqlite:///var/lib/tool-proxy/state.db"

    # the subchart renders the ConfigMap the snippet mounts; its checksum rolls the pod
    configmap = one(docs, "ConfigMap")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(volumes) == {"scratch", "tool-proxy-config", "tool-proxy-tmp", "tool-proxy-state"}
    assert volumes["tool-proxy-config"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert {m["name"] for m in proxy["volumeMounts"]} <= set(volumes)
    sha = hashlib.sha256(configmap["data"]["config.yaml"].encode()).hexdigest()
    assert pod["metadata"]["annotations"] == {"checksum/tool-proxy-config": sha}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5 + 20 + 30
    upstream = parse_config(yaml.safe_load(configmap["data"]["config.yaml"]), env={}).routes[0]
    assert upstream.upstream == "http://127.0.0.1:9000"
    assert find(docs, "Service") == []


def test_sidecar_snippets_refuse_standalone_values(parent_chart: Path) -> None:
    (parent_chart / "values.yaml").write_text(yaml.safe_dump({"toolProxy": {"mode": "standalone"}}))
    with helm.Chart.load(parent_chart) as loaded:
        assert "need mode=sidecar" in render_error(loaded, {})
