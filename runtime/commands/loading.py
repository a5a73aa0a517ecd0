"""Building the engine for a command (in this process, or in its own), with load errors as one line and a
startup summary."""

from __future__ import annotations

import logging
from typing import Any

from sits.runtime.commands.engine_args import fail
from sits.runtime.config import ConfigError, EngineConfig
from sits.runtime.engine.client import EngineClient

logger = logging.getLogger("sits.serve")


def load_engine(config: EngineConfig, prog: str, progress: bool = True, **hooks: Any) -> Any:
    """The AsyncEngine for config, or an exit code (2) after a one-line error for a bad model or option.

    `hooks` go to the engine (eviction policy, waiting queue, shared cache salt: the tenancy layer's)."""
    from sits.runtime.engine.async_engine import AsyncEngine
    from sits.runtime.engine.errors import EngineError
    from sits.runtime.models.errors import ModelLoadError

    try:
        engine = AsyncEngine.from_config(config, progress=progress, **hooks)
    except (ConfigError, ModelLoadError, FileNotFoundError, EngineError) as error:
        return fail(prog, str(error))
    log_engine_summary(engine, config)
    return engine


def spawn_engine(config: EngineConfig, prog: str, tenancy: Any = None, log_level: str = "info") -> Any:
    """The engine in its own process (`MultiprocessEngineClient`), or an exit code after a one-line
    error: 2 for a bad model or option (as `load_engine`), 1 when the process crashed while loading.

    `tenancy`: the server's Tenancy; the engine process builds its engine-side parts from it."""
    from sits.runtime.engine.core_client import EngineStartError, MultiprocessEngineClient

    try:
        engine = MultiprocessEngineClient.spawn(config, tenancy=tenancy, log_level=log_level)
    except EngineStartError as error:
        code = fail(prog, str(error))
        return code if error.user_error else 1
    log_engine_summary(engine, config)
    return engine


def log_engine_summary(engine: EngineClient, config: EngineConfig) -> None:
    stats = engine.stats()
    block_size = stats.kv_block_size or config.cache.block_size
    info = engine.model_info
    logger.info("model %s (%s) on %s, %s; max_model_len %d", engine.model_name, info.source, info.device,
                info.dtype, engine.max_model_len)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens; max_num_seqs %d, max_num_batched_tokens %d",
                stats.kv_blocks_total, block_size, stats.kv_blocks_total * block_size,
                config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
