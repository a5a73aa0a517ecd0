"""Building the AsyncEngine for a command, with load errors as one line and a startup summary."""

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


def log_engine_summary(engine: EngineClient, config: EngineConfig) -> None:
    stats = engine.stats()
    block_size = stats.kv_block_size or config.cache.block_size
    info = engine.model_info
    logger.info("model %s (%s) on %s, %s; max_model_len %d", engine.model_name, info.source, info.device,
                info.dtype, engine.max_model_len)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens; max_num_seqs %d, max_num_batched_tokens %d",
                stats.kv_blocks_total, block_size, stats.kv_blocks_total * block_size,
                config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
