"""The Alertmanager receiver: `POST /alertmanager` aborts the canary an alert names.

A firing alert labelled `namespace` and `sitsdeployment` (the chart's SitsCanaryP95Delta is one)
aborts that SitsDeployment's running canary. Resolved alerts, alerts without those labels, and
alerts that started firing before the current canary began are ignored (listed as such in the
answer). A malformed payload gets 400; a Kubernetes API error 503, so Alertmanager retries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from sits.operator.kube import ApiError
from sits.operator.reconciler import Reconciler
from sits.operator.status import from_timestamp

logger = logging.getLogger("sits.operator.webhook")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def build_app(reconciler: Reconciler, namespace: str | None = None) -> web.Application:
    """The receiver's aiohttp app; with `namespace`, alerts about other namespaces are ignored."""

    async def alertmanager(request: web.Request) -> web.Response:
        try:
            payload = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
            return _error(400, "expected an Alertmanager webhook payload: an object with an `alerts` list")
        results = []
        for alert in payload["alerts"]:
            result = await _handle_alert(reconciler, namespace, alert, payload.get("status"))
            if isinstance(result, web.Response):
                return result
            results.append(result)
        return web.json_response({"results": results})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/alertmanager", alertmanager)
    app.router.add_get("/healthz", healthz)
    return app


async def _handle_alert(reconciler: Reconciler, namespace: str | None, alert: Any,
                        group_status: Any) -> dict[str, Any] | web.Response:
    if not isinstance(alert, dict):
        return {"outcome": "ignored: not an alert object"}
    labels = alert.get("labels") if isinstance(alert.get("labels"), dict) else {}
    alertname = str(labels.get("alertname", "alert"))
    target_ns, target = labels.get("namespace"), labels.get("sitsdeployment")
    result: dict[str, Any] = {"alertname": alertname, "namespace": target_ns, "sitsdeployment": target}
    if alert.get("status", group_status) != "firing":
        return {**result, "outcome": "ignored: not firing"}
    if not isinstance(target_ns, str) or not isinstance(target, str) or not target_ns or not target:
        return {**result, "outcome": "ignored: no namespace and sitsdeployment labels"}
    if namespace is not None and target_ns != namespace:
        return {**result, "outcome": f"ignored: this operator watches namespace {namespace} only"}
    annotations = alert.get("annotations") if isinstance(alert.get("annotations"), dict) else {}
    summary = annotations.get("summary") or annotations.get("description") or ""
    message = f"alert {alertname} firing" + (f": {summary}" if summary else "")
    try:
        outcome = await asyncio.to_thread(reconciler.request_abort, target_ns, target, "AlertFiring", message,
                                          from_timestamp(alert.get("startsAt")))
    except ApiError as error:
        logger.warning("alert %s for %s/%s not acted on: %s", alertname, target_ns, target, error)
        return _error(503, f"the Kubernetes API failed: {error}")
    logger.info("alert %s for %s/%s: %s", alertname, target_ns, target, outcome)
    return {**result, "outcome": outcome}


async def start_webhook(reconciler: Reconciler, host: str, port: int,
                        namespace: str | None = None) -> web.AppRunner:
    """Listen on host:port; stop with `await runner.cleanup()`."""
    runner = web.AppRunner(build_app(reconciler, namespace), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("Alertmanager webhook listening on http://%s:%d/alertmanager", host, port)
    return runner
