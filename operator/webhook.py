"""The Alertmanager receiver: `POST /alertmanager` aborts the canary an alert names.

A firing alert labelled `namespace` and `sitsdeployment` (the chart's SitsCanaryP95Delta is one)
aborts that SitsDeployment's running canary, unless it started firing (`startsAt`) before that
canary began. Everything else (resolved alerts, alerts without those labels, unknown resources,
no canary running) is ignored.

The receiver is guarded and tells callers nothing about the cluster:
- every request needs `Authorization: Bearer <token>` (webhook_auth.BearerToken); without it or with
  a wrong one: 401;
- a well-formed payload gets the same answer whatever happened to its alerts (`{"status":
  "received"}`): what was done is logged and written to the resource, never answered, so the
  webhook cannot be used to list SitsDeployments or canary states;
- a malformed payload, or an alert without a valid RFC 3339 `startsAt`, gets 400 before any
  alert is acted on; a Kubernetes API error 503, so Alertmanager retries;
- the alert's name and summary reach the resource's RolledBack condition and Event only
  printable, on one line and at most MESSAGE_LIMIT characters long.
Errors have the shape `{"error": "<message>"}`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from aiohttp import web

from sits.operator.config import OperatorConfig
from sits.operator.kube import ApiError
from sits.operator.listen import listen
from sits.operator.reconciler import Reconciler
from sits.operator.status import from_timestamp
from sits.operator.webhook_auth import TOKEN_ENV, BearerToken, token_from

logger = logging.getLogger("sits.operator.webhook")

MESSAGE_LIMIT = 256  # characters of the alert's text written into the resource's condition
MAX_BODY_BYTES = 1 << 20  # Alertmanager's groups are a few KB; larger bodies get 413
RECEIVED = {"status": "received"}
# Kubernetes names: a namespace is a DNS label, a SitsDeployment's name a DNS subdomain. Anything else
# names nothing and never reaches the API (where a malformed path would be a 503 retried forever)
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
RESOURCE_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def printable(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line of printable characters, at most `limit` long (cut with an ellipsis)."""
    # str.isprintable is False for control, format (bidi overrides, zero-width) and separator characters
    text = " ".join("".join(char if char.isprintable() else " " for char in text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def condition_message(alertname: str, summary: str) -> str:
    """`alert NAME firing: SUMMARY`, printable, on one line, at most MESSAGE_LIMIT characters."""
    return printable(f"alert {alertname} firing" + (f": {summary}" if summary else ""))


def _start_times(payload: Any) -> list[float] | str:
    """Each alert's `startsAt` (Unix seconds), or why this is not a payload the receiver can act on."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        return "expected an Alertmanager webhook payload: an object with an `alerts` list"
    starts = []
    for index, alert in enumerate(payload["alerts"]):
        if not isinstance(alert, dict):
            return f"alerts[{index}] is not an object"
        started_at = from_timestamp(alert.get("startsAt"))
        if started_at is None:
            return f"alerts[{index}].startsAt is required: an RFC 3339 timestamp"
        starts.append(started_at)
    return starts


def build_app(reconciler: Reconciler, token: BearerToken | None, namespace: str | None = None) -> web.Application:
    """The receiver's aiohttp app; with `namespace`, alerts about other namespaces are ignored.

    `token` None leaves `POST /alertmanager` unauthenticated (`--webhook-allow-unauthenticated`).
    `GET /healthz` (readiness) never needs the token and says nothing but `{"status": "ok"}`.
    """

    async def alertmanager(request: web.Request) -> web.Response:
        if token is not None and not token.accepts(request.headers.get("Authorization")):
            return _error(401, "a valid bearer token is required", {"WWW-Authenticate": 'Bearer realm="sits-operator"'})
        try:
            payload = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        starts = _start_times(payload)
        if isinstance(starts, str):
            return _error(400, starts)
        for alert, started_at in zip(payload["alerts"], starts, strict=True):
            try:
                await _handle_alert(reconciler, namespace, alert, started_at, payload.get("status"))
            except ApiError as error:
                logger.warning("alert not acted on, Alertmanager will retry: %s", error)
                return _error(503, "the operator cannot reach the Kubernetes API; retry later")
        return web.json_response(RECEIVED)

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/alertmanager", alertmanager)
    app.router.add_get("/healthz", healthz)
    return app


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


async def _handle_alert(reconciler: Reconciler, namespace: str | None, alert: dict[str, Any],
                        started_at: float, group_status: Any) -> str:
    """Act on one validated alert; returns (and logs) what was done, in words. Raises ApiError."""
    labels = alert.get("labels") if isinstance(alert.get("labels"), dict) else {}
    annotations = alert.get("annotations") if isinstance(alert.get("annotations"), dict) else {}
    message = condition_message(_text(labels.get("alertname")) or "alert",
                                _text(annotations.get("summary")) or _text(annotations.get("description")))
    target_ns, target = _text(labels.get("namespace")), _text(labels.get("sitsdeployment"))
    if alert.get("status", group_status) != "firing":
        outcome = "ignored: not firing"
    elif not target_ns or not target:
        outcome = "ignored: no namespace and sitsdeployment labels"
    elif not NAMESPACE_NAME.fullmatch(target_ns) or not RESOURCE_NAME.fullmatch(target):
        outcome = "ignored: the namespace or sitsdeployment label is not a Kubernetes name"
    elif namespace is not None and target_ns != namespace:
        outcome = f"ignored: this operator watches namespace {namespace} only"
    else:
        outcome = await asyncio.to_thread(reconciler.request_abort, target_ns, target, "AlertFiring", message,
                                          started_at)
    logger.info("%s for %s/%s: %s", message, printable(target_ns, 63) or "-", printable(target, 253) or "-", outcome)
    return outcome


async def start_webhook(reconciler: Reconciler, token: BearerToken | None, host: str, port: int,
                        namespace: str | None = None) -> web.AppRunner:
    """Listen on host:port; stop with `await runner.cleanup()`."""
    runner = await listen(build_app(reconciler, token, namespace), host, port)
    logger.info("Alertmanager webhook listening on http://%s:%d/alertmanager (%s)", host, port,
                "bearer token required" if token is not None else "UNAUTHENTICATED")
    return runner


async def start_configured_webhook(reconciler: Reconciler, config: OperatorConfig) -> web.AppRunner | None:
    """The receiver as `config` asks for it: None when it is off (webhook_port 0, or no token given
    without webhook_allow_unauthenticated, which is logged as an error). Raises WebhookTokenError."""
    if not config.webhook_port:
        return None
    token = token_from(config.webhook_token_file, config.webhook_token)
    if token is None and not config.webhook_allow_unauthenticated:
        logger.error("the Alertmanager webhook is off: give it a bearer token with --webhook-token-file or "
                     "$%s (or accept any caller with --webhook-allow-unauthenticated)", TOKEN_ENV)
        return None
    if token is None:
        logger.warning("the Alertmanager webhook accepts unauthenticated requests: anyone who reaches port %d "
                       "can roll back canaries", config.webhook_port)
    return await start_webhook(reconciler, token, config.listen_host, config.webhook_port, config.namespace)
