"""A tenant's `models` allow-list goes from the SitsDeployment (spec.tenancy.tenants[].models) into the
runtime's tenant table in Redis and its tenants file, and follows edits; an invalid list is the
resource's InvalidSpec condition and leaves the stored table as it was."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import jsonschema
import pytest
import yaml

from sits.operator.fields import SpecError
from sits.operator.meta import API_VERSION, KIND
from sits.operator.spec import parse_spec
from sits.runtime.tenancy.state_store import open_state_store
from sits.runtime.tenancy.tenants import parse_tenants
from tests.operator.helpers import condition, sitsdeployment, wait_for, wait_for_status

NAME = "models"
CRD = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "sitsdeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CRD_HEAD = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": NAME}}


def secret(name: str, key: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "llm"},
            "data": {"token": base64.b64encode(key.encode()).decode()}}


async def read_table(url: str):
    store = open_state_store(url, deployment=f"llm.{NAME}")
    await store.start()
    try:
        return await store.get_tenant_table()
    finally:
        await store.close()


def stored_models(url: str) -> dict[str, tuple[str, ...] | None]:
    """Tenant -> models as a runtime replica reads the table the operator wrote (None: no table yet)."""
    record = asyncio.run(read_table(url))
    if record is None:
        return {}
    return {tenant.name: tenant.models for tenant in parse_tenants(record.document)}


def test_models_reach_the_tenant_table_and_an_empty_list_is_invalid(kube, deployments, run_operator, redis_service):
    url = f"redis://127.0.0.1:{redis_service.port}/0"
    kube.create(secret("alpha-key", "sk-alpha-1"))
    kube.create(secret("beta-key", "sk-beta-2"))
    tenants = [{"name": "alpha", "apiKeySecretRef": {"name": "alpha-key", "key": "token"}, "models": ["tiny", "sql"]},
               {"name": "beta", "apiKeySecretRef": {"name": "beta-key", "key": "token"}}]
    with run_operator():
        kube.create(sitsdeployment(NAME, tenancy={"redis": {"url": url}, "tenants": tenants}))
        wait_for_status(kube, NAME, lambda s: (s.get("tenancy") or {}).get("synced"), what="the table synced")
        assert stored_models(url) == {"alpha": ("tiny", "sql"), "beta": None}
        config_map = wait_for(lambda: kube.get("v1", "ConfigMap", "llm", f"{NAME}-engine"), what="the ConfigMap")
        listed = yaml.safe_load(config_map["data"]["tenants.yaml"])["tenants"]
        assert {t["name"]: t.get("models") for t in listed} == {"alpha": ["tiny", "sql"], "beta": None}

        # An edit of the list is written again: replicas pick it up on their next poll.
        edited = [dict(tenants[0]), dict(tenants[1], models=["tiny"])]
        kube.patch(API_VERSION, KIND, "llm", NAME, {"spec": {"tenancy": {"tenants": edited}}})
        wait_for(lambda: stored_models(url).get("beta") == ("tiny",), what="beta's list in Redis")
        version = asyncio.run(read_table(url)).version

        # An empty list is refused with the field's path; the stored table stays as it was.
        broken = [dict(tenants[0], models=[]), edited[1]]
        kube.patch(API_VERSION, KIND, "llm", NAME, {"spec": {"tenancy": {"tenants": broken}}})
        status = wait_for_status(kube, NAME, lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        assert condition(status, "InvalidSpec")["message"] == (
            "spec.tenancy.tenants[0].models: must list at least one model id (leave it out to allow every model)")
        record = asyncio.run(read_table(url))
        assert record.version == version and stored_models(url) == {"alpha": ("tiny", "sql"), "beta": ("tiny",)}


# Duplicates pass the schema here: the API server refuses them through x-kubernetes-list-type: set.
@pytest.mark.parametrize(("models", "where", "schema_refuses"), [
    ([], "models", True), (["tiny", ""], "models[1]", True), (["tiny", " sql"], "models[1]", True),
    (["sql", "sql"], "models[1]", False),
], ids=["empty", "blank", "spaces", "twice"])
def test_the_crd_and_the_operator_refuse_the_same_lists(models, where, schema_refuses):
    validator = jsonschema.Draft4Validator(SCHEMA)
    spec = sitsdeployment(NAME, tenancy={"tenants": [{"name": "a", "apiKeySecretRef": {"name": "s", "key": "k"},
                                                      "models": models}]})["spec"]
    with pytest.raises(SpecError) as refused:
        parse_spec(spec, NAME)
    assert refused.value.path == f"spec.tenancy.tenants[0].{where}"
    assert validator.is_valid({**CRD_HEAD, "spec": spec}) is not schema_refuses
    spec["tenancy"]["tenants"][0]["models"] = ["tiny", "sql"]
    validator.validate({**CRD_HEAD, "spec": spec})
    assert parse_spec(spec, NAME).tenancy.tenants[0].models == ("tiny", "sql")
