"""The Helm chart renders, lints strictly and validates as Kubernetes 1.30 objects, with default, full and kind values."""

from __future__ import annotations

import argparse
import base64

import helm_python
import kubernetes_validate
import pytest

from sits.operator.__main__ import add_arguments, config_from_args
from sits.operator.meta import Owner
from sits.operator.networking import build_services
from sits.operator.webhook_auth import BearerToken
from tests.packaging.chart import (
    CHART_DIR,
    FULL_VALUES,
    KIND_VALUES,
    KUBE_VERSION,
    NAMESPACE,
    ROOT,
    chart,
    load_values,
    objects,
    one,
    render,
)

VALUE_SETS = {"default": None, "full": FULL_VALUES, "kind": KIND_VALUES}
# Custom resources kubernetes-validate has no schema for (the Prometheus Operator's)
CUSTOM_KINDS = {"PrometheusRule", "ServiceMonitor"}
ERROR, WARNING = 3, 2


def values_of(name: str) -> dict:
    path = VALUE_SETS[name]
    return {} if path is None else load_values(path)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict_has_no_errors_or_warnings(name):
    report = helm_python.lint(CHART_DIR, values_of(name), strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}")
    findings = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert report["errors"] == [] and findings == [], report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_built_in_object_is_valid_for_kubernetes_1_30(name):
    chart().validate_schema(values_of(name))
    objs = objects(values_of(name))
    assert objs
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)  # raises ValidationError


def test_defaults_render_only_the_operator_and_what_it_needs():
    kinds = sorted(o["kind"] for o in objects())
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "NetworkPolicy", "Secret",
                     "Service", "Service", "ServiceAccount"]


def test_full_values_render_every_optional_part():
    objs = objects(values_of("full"))
    kinds = {o["kind"] for o in objs}
    assert {"Role", "RoleBinding", "StatefulSet", "PrometheusRule", "ServiceMonitor"} <= kinds
    assert one(objs, "Role")["metadata"]["namespace"] == "llm"
    assert one(objs, "ConfigMap", "-dashboard")["metadata"]["namespace"] == "monitoring"
    redis = one(objs, "StatefulSet", "-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "standard"
    notes = render(values_of("full"))["sits-operator/templates/NOTES.txt"]
    assert "redis://sits-sits-operator-redis.sits-system.svc:6379/0" in notes
    assert "http://sits-sits-operator-webhook.sits-system.svc:9081/alertmanager" in notes


def test_the_charts_crd_is_the_repositorys_crd():
    top_level = (ROOT / "crds" / "sitsdeployment.yaml").read_text()
    assert [c["filename"] for c in chart().crds] == ["sits-operator/crds/sitsdeployment.yaml"]
    assert chart().crds[0]["data"] == top_level, "charts/sits-operator/crds/ drifted: copy crds/sitsdeployment.yaml"
    assert (CHART_DIR / "crds" / "sitsdeployment.yaml").read_text() == top_level


@pytest.mark.parametrize("name", ["default", "full"])
def test_the_operator_pod_is_locked_down(name):
    deployment = one(objects(values_of(name)), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "webhook"}
    assert deployment["spec"]["strategy"]["type"] == ("RollingUpdate" if name == "full" else "Recreate")
    for workload in (o for o in objects(values_of(name)) if o["kind"] == "StatefulSet"):
        redis = workload["spec"]["template"]["spec"]
        assert redis["securityContext"]["runAsNonRoot"] is True
        assert redis["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # the args are flags the operator accepts, and they say what the values say
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(container["args"]))
    assert (config.health_port, config.webhook_port) == (ports["metrics"], ports["webhook"])
    assert config.listen_host == "0.0.0.0"
    values = chart().merge_values(values_of(name))["operator"]
    assert config.namespace == (values["watchNamespace"] or None)
    assert config.peering == (values["peering"] or None)
    assert config.resync_interval_s == values["resyncIntervalSeconds"]
    assert config.tenancy_interval_s == values["tenancyIntervalSeconds"]


def test_the_webhook_service_reaches_the_receiver_port():
    objs = objects(values_of("full"))
    service = one(objs, "Service", "-webhook")
    pod = one(objs, "Deployment")["spec"]["template"]
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 9081, "targetPort": "webhook", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


@pytest.mark.parametrize("name", ["default", "full"])
def test_the_metrics_service_reaches_the_operators_health_server(name):
    objs = objects(values_of(name))
    service = one(objs, "Service", "-metrics")
    pod = one(objs, "Deployment")["spec"]["template"]
    health_port = chart().merge_values(values_of(name))["operator"]["healthPort"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": health_port, "targetPort": "metrics",
                                         "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": health_port, "protocol": "TCP"} in container["ports"]


def test_the_operator_service_monitor_scrapes_the_metrics_service_keeping_the_resources_namespace():
    objs = objects(values_of("full"))
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"sits-sits-operator", "sits-sits-operator-runtime"}
    monitor = monitors["sits-sits-operator"]
    service = one(objs, "Service", "-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    # the operator's series carry the SitsDeployment's `namespace`; without honorLabels Prometheus would
    # rename it exported_namespace and put the operator pod's namespace there, emptying the dashboard
    assert endpoint["honorLabels"] is True
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (runtime_endpoint,) = monitors["sits-sits-operator-runtime"]["spec"]["endpoints"]
    # the runtime's --metrics-port, as the per-track Services the operator builds name it
    assert (runtime_endpoint["port"], runtime_endpoint["path"]) == ("metrics", "/metrics")
    assert "metrics" in {p["name"] for s in build_services(Owner("x", "llm", "uid"))[1:] for p in s["spec"]["ports"]}
    only_operator = objects({**values_of("full"), "serviceMonitor": {"enabled": True, "runtime": False}})
    assert [o["metadata"]["name"] for o in only_operator if o["kind"] == "ServiceMonitor"] == ["sits-sits-operator"]
    assert not [o for o in objects() if o["kind"] == "ServiceMonitor"]


def test_the_dashboard_config_map_carries_the_sidecar_label_and_the_json():
    config_map = one(objects(), "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"]["sits.json"].strip() == (CHART_DIR / "dashboards" / "sits.json").read_text().strip()


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"replicas": "two"}}, "replicas"),
    ({"operator": {"webhookPort": 70000}}, "webhookPort"),
    ({"operator": {"watchNamespace": "Not_A_Namespace"}}, "watchNamespace"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"redis": {"existingUrl": "http://redis:6379"}}, "existingUrl"),
    ({"prometheusRule": {"quantile": 1.5}}, "quantile"),
    ({"prometheusRule": {"window": "five minutes"}}, "window"),
    ({"serviceMonitor": {"interval": 15}}, "interval"),
    ({"serviceMonitor": {"runtime": "yes"}}, "runtime"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "cpu"),
    ({"unknownKey": True}, "unknownKey"),
    ({"networkPolicy": {"enabled": "yes"}}, "enabled"),
    ({"networkPolicy": {"prometheus": {"podSelector": {"matchLabel": {}}}}}, "matchLabel"),
    ({"webhook": {"token": {"existingSecret": "Not_A_Name"}}}, "existingSecret"),
])
def test_the_values_schema_rejects_bad_values(values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message):
        chart().validate_schema(chart().merge_values(values))


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"replicas": 2}}, "needs operator.peering"),
    ({"redis": {"enabled": True, "existingUrl": "redis://mine:6379/0"}}, "not both"),
    ({"operator": {"healthPort": 8081}}, "must differ"),
])
def test_values_that_cannot_work_fail_the_render_with_a_reason(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def operator_container(objs: list[dict]) -> tuple[dict, dict]:
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container, pod


def token_file_of(container: dict, pod: dict) -> tuple[str, dict]:
    """The --webhook-token-file path and the Secret volume that puts a file there."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    path = config_from_args(parser.parse_args(container["args"])).webhook_token_file
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (item,) = volume["secret"]["items"]
    assert item["path"] == path[len(mount["mountPath"]) + 1:]
    return path, volume["secret"]


def test_the_chart_creates_the_webhook_token_and_mounts_it_where_the_operator_reads_it():
    objs = objects()
    container, pod = operator_container(objs)
    path, secret_volume = token_file_of(container, pod)
    assert path == "/etc/sits-operator/webhook/token"
    assert not [arg for arg in container["args"] if "unauthenticated" in arg]  # the webhook always needs it
    secret = one(objs, "Secret", "-webhook-token")
    assert secret_volume["secretName"] == secret["metadata"]["name"] == "sits-sits-operator-webhook-token"
    assert secret_volume["items"][0]["key"] == "token" and secret_volume["defaultMode"] == 0o440
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert BearerToken(token=token).accepts(f"Bearer {token}")  # a token the operator takes
    assert base64.b64decode(one(objects(), "Secret", "-webhook-token")["data"]["token"]).decode() != token  # random
    notes = render()["sits-operator/templates/NOTES.txt"]
    assert "authorization:\n                 type: Bearer\n" in notes
    assert "credentials_file: /etc/alertmanager/secrets/sits-sits-operator-webhook-token/token" in notes
    assert "get secret sits-sits-operator-webhook-token -o jsonpath='{.data.token}'" in notes


def test_an_existing_secret_replaces_the_charts_token():
    objs = objects({"webhook": {"token": {"existingSecret": "alertmanager-webhook", "key": "bearer"}}})
    assert not [o for o in objs if o["kind"] == "Secret"]
    path, secret_volume = token_file_of(*operator_container(objs))
    assert secret_volume["secretName"] == "alertmanager-webhook"
    assert secret_volume["items"] == [{"key": "bearer", "path": "token"}] and path.endswith("/token")
    notes = render({"webhook": {"token": {"existingSecret": "alertmanager-webhook", "key": "bearer"}}})[
        "sits-operator/templates/NOTES.txt"]
    assert "credentials_file: /etc/alertmanager/secrets/alertmanager-webhook/bearer" in notes


@pytest.mark.parametrize("name", ["default", "full"])
def test_the_network_policy_admits_alertmanager_to_the_webhook_and_prometheus_to_the_metrics(name):
    values = chart().merge_values(values_of(name))
    objs = objects(values_of(name))
    policy = one(objs, "NetworkPolicy")
    container, _pod = operator_container(objs)
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (API server, Prometheus, Redis) stays open
    container_ports = {p["name"] for p in container["ports"]}
    admitted = {}
    for rule in policy["spec"]["ingress"]:
        ((port,), (peer,)) = (rule["ports"], rule["from"])
        assert port["port"] in container_ports and port["protocol"] == "TCP"
        admitted[port["port"]] = peer
    network = values["networkPolicy"]
    assert admitted == {"webhook": network["alertmanager"], "metrics": network["prometheus"]}
    if name == "default":  # kube-prometheus-stack in `monitoring`
        assert admitted["webhook"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "alertmanager"}}
        assert admitted["webhook"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    notes = render(values_of(name))["sits-operator/templates/NOTES.txt"]
    assert "admits only Alertmanager's pods to the webhook port" in notes
    assert not [o for o in objects({"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"]
