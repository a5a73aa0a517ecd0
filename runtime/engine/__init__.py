"""The inference engine: scheduling, the paged KV cache, sampling and the step loop.

    LLMEngine (engine.py)        add_request / step / abort_request / stats, single-threaded; async
                                  scheduling (the next step launched before the last one's outputs
                                  are processed); model set-up in engine_setup.py
    AsyncEngine (async_engine.py) the step loop on a background thread, asyncio streams
    Scheduler (scheduler.py)      continuous batching, chunked prefill, preemption by recompute;
                                  contract in scheduler_interface.py, ordering in scheduling_policy.py
    KVCacheManager (kv_cache.py)  block tables and prefix hits over BlockPool (block_pool.py),
                                  prefix hashes (prefix_hash.py), eviction (eviction.py),
                                  which tenant holds which block (block_owners.py),
                                  sizing from a memory budget (cache_sizing.py)
    ModelRunner (runner.py)       flat batches (model_input.py) from a persistent batch of block
                                  tables (input_batch.py), the model, Sampler (sampler.py); a
                                  launched step's tokens reach the host as a PendingOutput
    OutputProcessor               detokenization and stop strings (detokenizer.py) into RequestOutputs

Import from the modules themselves (`from sits.runtime.engine.engine import LLMEngine`): this
package imports nothing, so `sits.runtime.engine.request` stays light for the server.
"""
