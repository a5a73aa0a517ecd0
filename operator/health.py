"""The operator's health server (--health-port): `GET /healthz` for liveness, `GET /metrics` for Prometheus.

It runs on the operator's event loop, from kopf's startup to its cleanup, so `/healthz` answers
exactly while the operator runs and its loop is responsive (what kopf's own liveness endpoint did).
`/metrics` answers in the format the scraper asks for (Prometheus text, or OpenMetrics).
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from sits.operator.listen import listen

logger = logging.getLogger("sits.operator.health")


def build_health_app(registry: CollectorRegistry) -> web.Application:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


async def start_health_server(registry: CollectorRegistry, host: str, port: int) -> web.AppRunner:
    """Listen on host:port; stop with `await runner.cleanup()`."""
    runner = await listen(build_health_app(registry), host, port)
    logger.info("health and metrics on http://%s:%d/healthz and /metrics", host, port)
    return runner
