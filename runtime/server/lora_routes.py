"""vLLM's runtime LoRA endpoints (`--allow-runtime-lora-updating`): load and unload adapters while serving.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql" | "hf://org/name[@rev]"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Both answer 200 with a one-line text, as vLLM does; errors are OpenAI's JSON. Without the flag the
routes do not exist (404 like any unknown URL, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING).

Load reads and checks the adapter off the step loop (a Hub download or a large file never stalls
the event loop or a step), then the engine writes it into a free slot between two steps: 400 for a name
already served (or being loaded), the base model's name, no free slot (--max-loras), or an adapter
that does not fit the model (the loader's message). The adapter serves requests and appears in
/v1/models as soon as the call returns.

Unload: 404 for a name not served. An adapter with requests in flight is refused with 409
(`adapter_in_use`): the operator retries once they end, and no running stream is cut or switched to
another adapter. Otherwise new requests for it are refused at once, the engine zeroes its
slot between steps, and it is gone: a 404 `model_not_found` for new requests, absent from /v1/models.

Who may call them: with `--tenants`, a key of a tenant marked `admin: true` (others: 403); with
`--api-key`, that key (401 without, as for every /v1 route); with neither, anyone (as vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from sits.runtime.engine.client import EngineClient
from sits.runtime.engine.errors import EngineDeadError, EngineDiedError, EngineShuttingDownError
from sits.runtime.lora.config import LoraConfigError, LoraFileError, LoraModule
from sits.runtime.lora.roots import AdapterPathRefused, checked_adapter_path, is_hub_id
from sits.runtime.metrics_collector import SERVER_LABELS
from sits.runtime.server.collector import ScrapeCollector
from sits.runtime.server.errors import OpenAIError, invalid_request
from sits.runtime.server.tenant import request_tenant, tenant_of

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str


def runtime_updates_enabled(engine: EngineClient) -> bool:
    """Whether the engine was started with --enable-lora --allow-runtime-lora-updating."""
    return engine.model_info.lora_runtime_updates


class LoraUpdater:
    """Loads and unloads the adapters of an engine whose LoRA manager allows runtime updates.

    Args:
        engine: the engine (in this process or its own).
        base_model: the served base model's id (no adapter may take it).
    """

    def __init__(self, engine: EngineClient, base_model: str, roots: Sequence[Path] = ()) -> None:
        self.engine = engine
        self.roots = tuple(roots)  # --lora-root: where local adapters may come from (`sits.runtime.lora.roots`)
        self.num_slots = engine.model_info.lora_num_slots
        self.base_model = base_model
        self._loading: set[str] = set()  # names being read; event-loop only

    async def load(self, name: str, path: str) -> str:
        if not name.strip() or not path.strip():
            raise invalid_request("Both 'lora_name' and 'lora_path' must be non-empty.", param="lora_name")
        if name == self.base_model:
            raise invalid_request(f"The lora adapter name '{name}' is the base model's; pick another name.",
                                  param="lora_name")
        served = self.engine.lora_modules
        if name in served or name in self._loading:
            raise invalid_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if len(served) + len(self._loading) >= self.num_slots:
            raise invalid_request(f"No free LoRA slot: all {self.num_slots} slots (--max-loras) hold "
                                  "adapters; unload one first or raise --max-loras.", code="no_free_lora_slot")
        self._loading.add(name)
        try:
            await self.engine.load_lora(LoraModule(name, checked_adapter_path(path, self.roots)))
        except AdapterPathRefused as refused:
            raise _path_refused(refused) from None
        except (EngineDeadError, EngineDiedError, EngineShuttingDownError):  # not the adapter's fault
            raise
        except LoraConfigError as error:
            # A local adapter whose files are missing or cannot be read gets one answer whatever the
            # reason: those errors (no such directory, a parser's message) would tell a caller what
            # exists on the server. One that reads but does not fit the model is told why.
            if isinstance(error, LoraFileError) and not is_hub_id(path):
                raise _path_refused(AdapterPathRefused()) from None
            raise invalid_request(str(error), param="lora_path") from None
        except Exception:  # whatever else reading a local file raised (a hub download's error is its own)
            if is_hub_id(path):
                raise
            raise _path_refused(AdapterPathRefused()) from None
        finally:
            self._loading.discard(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        if name not in self.engine.lora_modules:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="model_not_found")
        busy = self.engine.lora_usage.close(name)  # from now on new requests for it are refused
        if busy:
            raise OpenAIError(409, f"The lora adapter '{name}' has {busy} request(s) in flight; unload it once "
                                   "they have ended.", param="lora_name", code="adapter_in_use",
                              error_type="invalid_request_error")
        try:
            await self.engine.unload_lora(name)
        finally:
            self.engine.lora_usage.reopen(name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def _path_refused(refused: AdapterPathRefused) -> OpenAIError:
    return invalid_request(str(refused), param="lora_path", code="lora_path_refused")


def admin_only(tenants_configured: bool) -> Any:
    """A dependency (run before the body is read): 403 unless the caller may change adapters, which
    with --tenants only a tenant marked admin may."""

    async def check_admin(request: Request, _tenant: str = Depends(request_tenant)) -> None:
        if tenants_configured:
            _require_admin(request)

    return check_admin


def _require_admin(request: Request) -> None:
    tenant = tenant_of(request)
    if tenant is None or not tenant.admin:
        raise OpenAIError(403, "Loading and unloading LoRA adapters needs the key of a tenant marked "
                               "`admin: true` in the tenants file.", code="permission_denied")


class LoraAdaptersCollector(ScrapeCollector):
    """`sits_lora_adapters_loaded` and `sits_lora_slots`: adapters served now and the slots they may fill."""

    def __init__(self, engine: EngineClient, model: str, track: str) -> None:
        super().__init__(model, track)
        self._engine = engine
        self._num_slots = engine.model_info.lora_num_slots

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        loaded = len(self._engine.lora_modules)
        for name, doc, value in (("sits_lora_adapters_loaded", "LoRA adapters served now.", loaded),
                                 ("sits_lora_slots", "LoRA adapter slots (--max-loras).", self._num_slots)):
            family = GaugeMetricFamily(name, doc, labels=SERVER_LABELS)
            family.add_metric(self._labels, value)
            yield family


def install_lora_routes(app: FastAPI, engine: EngineClient, base_model: str, tenancy: Any, metrics: Any,
                        track: str) -> None:
    """Add the two endpoints and the adapter gauges when the engine allows runtime updates; else nothing."""
    if not runtime_updates_enabled(engine):
        return
    security = getattr(app.state, "security", None)
    updater = LoraUpdater(engine, base_model, getattr(security, "lora_roots", ()))
    tenants_configured = getattr(getattr(tenancy, "config", None), "tenants_file", None) is not None
    metrics.register(LoraAdaptersCollector(engine, base_model, track))

    admin = [Depends(admin_only(tenants_configured))]

    @app.post(LOAD_PATH, dependencies=admin)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await updater.load(body.lora_name, body.lora_path))

    @app.post(UNLOAD_PATH, dependencies=admin)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await updater.unload(body.lora_name))
