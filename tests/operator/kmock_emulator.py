"""KMock's Kubernetes API emulator with the fixes kopf needs.

KMock 0.8's `KubernetesEmulator` makes kopf stall or handle events twice. `FixedEmulator` keeps its
storage and discovery but owns every state change:
- create and patch stamp `metadata.namespace`, `uid`, `generation` (bumped when spec changes) and
  an increasing `resourceVersion`; lists answer the newest resourceVersion;
- a JSON patch whose `test` op fails is a 422 (kopf retries its optimistic patches on 422; KMock
  answered 500);
- `status` of resources with a status subresource changes only through `/status`, as on a real
  API server (KMock merged any patch into the whole object);
- watches resume from the requested `resourceVersion` out of an event log written under the same
  lock as the objects (KMock replayed every object and lost the events between list and watch);
- `/api/v1/namespaces` is the namespaces resource (KMock failed to parse it);
- server-side apply (`application/apply-patch+yaml`) replaces what the one field manager applied,
  as the API server does when a single manager owns the fields (KMock merged it);
- DELETE honours finalizers; discovery names the core group version `v1` (KMock: `/v1`, which hides
  every core resource from kubectl) and prefers a group's newest version (KMock: any, at random);
- resource requests are answered directly, skipping KMock's reaction matching (no test here
  defines reactions, and the matching cost ~10 ms per request, the whole reconcile budget).

`tests.operator.kmock_cluster.KMockCluster` serves it on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import datetime as dt
import json
import re
import secrets
import time
import uuid
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import dicts as kmock_dicts
from kmock._internal import parsing as kmock_parsing


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _strip_directives(value: Any) -> Any:
    """Drop strategic-merge-patch directives (`$setElementOrder/...`, `$patch`): merged as plain JSON."""
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not str(k).startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' order of API versions: GA, then beta, then alpha; higher numbers first."""
    match = re.match(r"^v(\d+)(?:(alpha|beta)(\d+))?$", version)
    if match is None:
        return (0, 0, 0)
    stage = {"alpha": 1, "beta": 2}.get(match.group(2) or "", 3)
    return (stage, int(match.group(1)), int(match.group(3) or 0))


def _prefer_newest(group: dict[str, Any]) -> dict[str, Any]:
    """KMock picks a group's preferred version from a set, at random; kubectl then may ask v1beta1."""
    group["versions"].sort(key=lambda v: _version_priority(v["version"]), reverse=True)
    group["preferredVersion"] = group["versions"][0]
    return group


def _invalid(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", message=message, details={})


_parse_path = kmock_parsing.parse_path


def _parse_namespaces(path: str) -> kmock_parsing.ParsedPath:
    """KMock reads `/api/v1/namespaces[/name]` as a namespaced URL with no resource (and fails);
    it is the cluster-scoped `namespaces` resource, which kopf lists when given --namespace."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) in (3, 4) or (len(parts) == 5 and parts[4] in ("status", "finalize"))):
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces", namespace=None,
                                        name=parts[3] if len(parts) > 3 else None,
                                        subresource=parts[4] if len(parts) > 4 else None)
    return _parse_path(path)


kmock_parsing.parse_path = _parse_namespaces  # rendering.Request._parse looks it up on the module


class FixedEmulator(kmock.KubernetesEmulator):
    """KMock's emulator with consistent resourceVersions, resumable watches and real status semantics."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = 0
        self._log_rvs: list[int] = []
        self._log: list[tuple[Any, str | None, dict[str, Any]]] = []  # (resource, namespace, event)
        self._changed = asyncio.Condition()
        self._answers: dict[int, tuple[Any, str | None, str]] = {}

    # -- state changes --------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> Any:
        """Resource requests are answered here; discovery (/api, /apis, /version) goes through KMock.

        Besides owning every state change, this skips KMock's reaction matching for resource
        requests: no test here defines reactions, and matching costs ~10 ms a request on 2 cores.
        """
        if request.resource is None or request.action is None or request.resource not in self.resources:
            return await kmock.KubernetesScaffold._handle(self, request)
        try:
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
                if request.name is None and request.action != kmock.action.CREATE:
                    raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message="no collection writes",
                                                details={})
                async with self._lock:
                    {kmock.action.CREATE: self._create, kmock.action.UPDATE: self._update,
                     kmock.action.DELETE: self._delete}[request.action](request)
                async with self._changed:
                    self._changed.notify_all()
                answer = self.objects[self._answers.pop(id(request))].history.last.raw
                return aiohttp.web.json_response(answer, status=201 if request.action == kmock.action.CREATE else 200)
            if request.action == kmock.action.WATCH:
                return await self._stream(request)
            if request.action == kmock.action.LIST:
                return aiohttp.web.json_response(await self._list(request))
            return aiohttp.web.json_response(self._fetch(request))
        except kmock.KubernetesError as error:
            return await self._render_error(error)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, resource: Any, namespace: str | None, kind: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._log_rvs.append(rv)
        self._log.append((resource, namespace, {"type": kind, "object": obj}))

    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _create(self, request: kmock.Request) -> None:
        if not isinstance(request.data, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body must be an object")
        obj = copy.deepcopy(_strip_directives(request.data))
        meta = obj.setdefault("metadata", {})
        if request.namespace:
            meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if not meta.get("name"):
            raise _invalid("metadata.name: Required value")
        key = (request.resource, request.namespace, meta["name"])
        if key in self.objects and not self.objects[key].deleted:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists",
                                        message=f"{request.resource.plural} {meta['name']!r} already exists", details={})
        meta.pop("deletionTimestamp", None)
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now(), generation=1)
        if self._has_status(request.resource):
            obj.pop("status", None)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._record(request.resource, request.namespace, "ADDED", obj)
        self._answers[id(request)] = key

    def _update(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name!r} not found",
                                        details={})
        current = copy.deepcopy(self.objects[key].raw)
        if isinstance(request.data, list):
            try:
                new = jsonpatch.apply_patch(current, request.data, in_place=False)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as error:
                raise _invalid(f"the JSON patch does not apply: {error}") from None
        elif isinstance(request.data, dict) and "apply-patch" in request.headers.get("Content-Type", ""):
            # Server-side apply with one field manager: what it applied before and leaves out goes
            new = copy.deepcopy(request.data)
            if "status" in current:
                new["status"] = current["status"]
        elif isinstance(request.data, dict):
            patch = copy.deepcopy(_strip_directives(request.data))
            if self._has_status(request.resource):
                if request.subresource == "status":
                    patch = {"status": patch.get("status")} if "status" in patch else {}
                else:
                    patch.pop("status", None)
            new = kmock_dicts.patch_dict(current, patch)
        else:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="unsupported patch body")
        meta = new.setdefault("metadata", {})
        for field in ("name", "namespace", "uid", "creationTimestamp"):
            meta[field] = current["metadata"].get(field)
        meta["generation"] = current["metadata"].get("generation", 1) + (new.get("spec") != current.get("spec"))
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].history.append(new)
            self.objects[key].delete()
            self._record(request.resource, request.namespace, "DELETED", new)
        else:
            self.objects[key].history.append(new)
            self._record(request.resource, request.namespace, "MODIFIED", new)
        self._answers[id(request)] = key

    def _delete(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name!r} not found",
                                        details={})
        obj = copy.deepcopy(self.objects[key].raw)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        if obj["metadata"].get("finalizers"):
            obj["metadata"].setdefault("deletionTimestamp", _now())
            self.objects[key].history.append(obj)
            self._record(request.resource, request.namespace, "MODIFIED", obj)
        else:
            self.objects[key].history.append(obj)
            self.objects[key].delete()
            self._record(request.resource, request.namespace, "DELETED", obj)
        self._answers[id(request)] = key

    # -- answers --------------------------------------------------------------------------------

    async def _serve_apis(self, request: kmock.Request) -> Any:
        answer = await super()._serve_apis(request)
        for group in answer["groups"]:
            _prefer_newest(group)
        return answer

    async def _serve_group(self, request: kmock.Request) -> Any:
        return _prefer_newest(await super()._serve_group(request))

    async def _serve_version(self, request: kmock.Request) -> Any:
        # KMock names the core group version "/v1"; kubectl then finds no core resource at all
        answer = await super()._serve_version(request)
        answer["groupVersion"] = answer["groupVersion"].lstrip("/")
        return answer

    def _fetch(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name!r} not found",
                                        details={})
        return self.objects[key].raw

    def _matching(self, request: kmock.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector") or ""
        required = dict(part.split("=", 1) for part in selector.replace("==", "=").split(",") if "=" in part)
        items = []
        for (resource, namespace, _name), obj in self.objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            labels = obj.raw.get("metadata", {}).get("labels") or {}
            if all(labels.get(k) == v for k, v in required.items()):
                items.append(obj.raw)
        return items

    async def _list(self, request: kmock.Request) -> dict[str, Any]:
        async with self._lock:
            items = self._matching(request)
            version = str(self._rv)
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": version}, "items": items}

    async def _stream(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)  # the headers now: the stream is open even if nothing happens
        with contextlib.suppress(ConnectionError):
            async for event in self._events(request):
                await response.write(json.dumps(event).encode() + b"\n")
        return response

    async def _events(self, request: kmock.Request) -> Any:
        since = request.params.get("resourceVersion") or "0"
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self._lock:
            if since == "0":
                for obj in self._matching(request):
                    yield {"type": "ADDED", "object": obj}
                last = self._rv
            else:
                last = int(since)
        while deadline is None or time.monotonic() < deadline:
            async with self._changed:
                if (self._log_rvs[-1] if self._log_rvs else 0) <= last:
                    wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), wait)
            start = bisect.bisect_right(self._log_rvs, last)
            pending = list(zip(self._log_rvs[start:], self._log[start:], strict=True))
            for rv, (resource, namespace, event) in pending:
                last = rv
                if resource == request.resource and request.namespace in (None, namespace):
                    yield event
