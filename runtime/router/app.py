"""The router's HTTP app: the replicas' OpenAI routes, authenticated here, routed, proxied.

    POST /v1/chat/completions, /v1/completions   401 before routing; hashed, scored, forwarded
    GET  /v1/models, POST /tokenize, /detokenize  authenticated, forwarded to the least loaded
    any other /v1/... route                      authenticated, forwarded (the replica answers it)
    GET  /health                                 200 while a replica is up, else 503 (readiness)
    GET  /health/live                            200 while the router serves (liveness: no replica up
                                                 is no reason to restart it)
    GET  /metrics                                the router's Prometheus metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sits.runtime.router.canary import CanarySplit
from sits.runtime.router.config import RouterConfig
from sits.runtime.router.discovery import EndpointSliceDiscovery, ServiceRef
from sits.runtime.router.index import KVIndex, RoutingHistory
from sits.runtime.router.kv_events import KVStateReader
from sits.runtime.router.metrics import RouterMetrics
from sits.runtime.router.policy import Decision, Router
from sits.runtime.router.prompt import EMPTY_KEY, PromptHasher, PromptKey
from sits.runtime.router.proxy import Forwarder, unavailable
from sits.runtime.router.replicas import ReplicaPool
from sits.runtime.server.errors import OpenAIError
from sits.runtime.tenancy.auth import AuthenticationError
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy
from sits.runtime.tenancy.tenants import Tenant

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
INLINE_HASH_BYTES = 32_768  # larger bodies are tokenized and hashed off the event loop


@dataclass
class RouterState:
    """The parts of one router process (app.state.router)."""

    config: RouterConfig
    tenancy: Tenancy
    hasher: PromptHasher
    index: KVIndex
    history: RoutingHistory
    router: Router
    metrics: RouterMetrics
    canary: CanarySplit
    services: list[ServiceRef] = field(default_factory=list)
    pool: ReplicaPool | None = None
    forwarder: Forwarder | None = None
    kv_reader: KVStateReader | None = None
    discovery: EndpointSliceDiscovery | None = None


def build_router_state(config: RouterConfig, hasher: PromptHasher) -> RouterState:
    """Everything but the network parts (started in the app's lifespan). Raises ConfigError /
    TenantConfigError for bad options."""
    config.validate()
    services = [ServiceRef.parse(text) for text in config.discover]  # ConfigError before any I/O
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=config.tenants_file, state_store=config.state_store,
                                                deployment=config.deployment))
    index, history = KVIndex(), RoutingHistory(config.history_blocks)
    router = Router(config.policy, config.weights, index, history, recent_s=config.recent_s)
    canary = CanarySplit(config.canary_weight, config.canary_tenants)
    return RouterState(config, tenancy, hasher, index, history, router, RouterMetrics(), canary, services)


def build_app(state: RouterState) -> Starlette:
    """The router app over `state` (`app.state.router`); its lifespan connects to the store and the replicas."""
    routes = [Route(path, _generation, methods=["POST"]) for path in GENERATION_PATHS] + [
        Route("/health", _health, methods=["GET"]),
        Route("/health/live", _live, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/tokenize", _passthrough, methods=["POST"]),
        Route("/detokenize", _passthrough, methods=["POST"]),
        Route("/v1/{rest:path}", _passthrough, methods=["GET", "POST", "DELETE"]),
    ]
    app = Starlette(routes=routes, lifespan=_lifespan)
    app.state.router = state
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    """Start the network parts of `app.state.router` (client, pool, store reader, discovery); stop them after."""
    state: RouterState = app.state.router
    config = state.config
    timeout = httpx.Timeout(connect=2.0, read=None, write=30.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=2048,
                                                                     max_keepalive_connections=256)) as client:
        state.pool = ReplicaPool(config.replicas, client, interval_s=config.health_interval_s,
                                 metrics_port=config.replica_metrics_port)
        state.forwarder = Forwarder(client, state.pool, state.metrics)
        await state.tenancy.start()
        if config.state_store.startswith(("redis://", "rediss://", "unix://")):
            state.kv_reader = KVStateReader(config.state_store, config.deployment, state.index,
                                            interval_s=config.kv_poll_interval_s)
            await state.kv_reader.start()
        await state.pool.start()
        if state.services:
            state.discovery = EndpointSliceDiscovery(state.services, state.pool, config.kube_api)
            await state.discovery.start()
        try:
            yield
        finally:
            if state.discovery is not None:
                await state.discovery.close()
            await state.pool.close()
            if state.kv_reader is not None:
                await state.kv_reader.close()
            await state.tenancy.close()


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


async def _generation(request: Request) -> Response:
    state = _state(request)
    tenant = _authenticate(state, request)
    if isinstance(tenant, Response):
        return tenant
    body = await request.body()
    if len(body) > INLINE_HASH_BYTES:
        key = await asyncio.to_thread(_prompt_key, state, request.url.path, body, tenant)
    else:
        key = _prompt_key(state, request.url.path, body, tenant)
    return await _route(state, request, body, key, tenant)


async def _passthrough(request: Request) -> Response:
    state = _state(request)
    tenant = _authenticate(state, request)
    if isinstance(tenant, Response):
        return tenant
    return await _route(state, request, await request.body(), EMPTY_KEY, tenant)


async def _health(request: Request) -> Response:
    state = _state(request)
    up = state.pool.up() if state.pool else []
    status = 200 if up else 503
    return JSONResponse({"status": "ok" if up else "no replica is up", "replicas_up": len(up)}, status_code=status)


async def _live(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def _metrics(request: Request) -> Response:
    state = _state(request)
    for replica in state.pool.replicas if state.pool else []:
        state.metrics.replica_up.labels(replica.url, replica.track).set(1.0 if replica.up else 0.0)
        state.metrics.in_flight.labels(replica.url).set(replica.in_flight)
        published = state.index.get(replica.replica_id)
        state.metrics.index_blocks.labels(replica.url).set(len(published.block_hashes) if published else 0)
    state.metrics.store_up.set(1.0 if state.kv_reader is not None and state.kv_reader.up else 0.0)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _authenticate(state: RouterState, request: Request) -> Tenant | Response:
    """The request's tenant, as the replicas authenticate it; a 401 in OpenAI's shape otherwise."""
    try:
        return state.tenancy.authenticate(request.headers)
    except AuthenticationError as error:
        return OpenAIError(401, error.message, code=error.code, error_type="invalid_request_error",
                           headers={"WWW-Authenticate": "Bearer"}).to_response()


def _prompt_key(state: RouterState, path: str, body: bytes, tenant: Tenant) -> PromptKey:
    """The prompt's block hashes under the tenant's salt; EMPTY_KEY when it cannot be hashed
    (the replica then answers whatever is wrong with it)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return EMPTY_KEY
    prompt = state.hasher.prompt_ids(path, parsed)
    if prompt is None:
        return EMPTY_KEY
    token_ids, lora, shared = prompt
    table = state.tenancy.table
    if shared and not table.shared_prefix_pool:
        return EMPTY_KEY  # the replica refuses it with a 400
    return state.hasher.key(token_ids, table.prefix_salt(tenant, shared), lora)


async def _route(state: RouterState, request: Request, body: bytes, key: PromptKey, tenant: Tenant) -> Response:
    assert state.pool is not None and state.forwarder is not None  # set by the lifespan
    replicas = state.pool.up()
    if not replicas:
        return unavailable()
    track, others = state.canary.split(replicas, tenant.name)
    decision: Decision = state.router.choose(track, key)
    decision = Decision([*decision.order, *others], decision.reason, decision.matched_blocks)
    if key.block_hashes:
        state.history.record(decision.order[0].url, key.block_hashes)
        state.metrics.prefix_match.labels(tenant.name).observe(decision.matched_blocks / len(key.block_hashes))
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return await state.forwarder.forward(request.method, path, request.headers.items(), body,
                                         decision.order, decision.reason)
