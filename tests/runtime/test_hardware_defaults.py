"""Hardware defaults: throughput mode (fp8 weights + fp8 KV cache on an H200-class GPU) and the flags
that override it. GPU profiles are built by hand: the rule is a pure function of the profile."""

from __future__ import annotations

import argparse
import logging

from sits.runtime.commands.engine_args import add_engine_arguments, engine_config_from_args
from sits.runtime.hardware import (
    GIB,
    THROUGHPUT_DEFAULTS,
    GpuProfile,
    engine_defaults,
    throughput_mode,
)


def _profile(name="NVIDIA H200", family="H200", total_gib=141, free_gib=139, capability=(9, 0)) -> GpuProfile:
    return GpuProfile(name, family, total_gib * GIB, free_gib * GIB, 4.29e12, 785e12, 1430e12, 132, capability)


def test_throughput_mode_needs_fp8_weights_an_fp8_cache_sm9_and_the_memory():
    h200 = _profile()
    assert throughput_mode(h200, "fp8", "fp8")
    assert throughput_mode(h200, "fp8", "fp8_e4m3")
    assert not throughput_mode(h200, "fp8", "auto")  # a bf16 cache holds half the sequences
    assert not throughput_mode(h200, "none", "fp8")
    assert not throughput_mode(h200, "int8", "fp8")
    assert not throughput_mode(_profile("NVIDIA H100", "H100", 80, 78), "fp8", "fp8")
    assert not throughput_mode(_profile(free_gib=100), "fp8", "fp8")  # another process holds memory
    assert not throughput_mode(_profile("NVIDIA B200", "other", 180, 178, (10, 0)), "fp8", "fp8")
    assert not throughput_mode(None, "fp8", "fp8")


def test_throughput_defaults_grow_the_limits_and_bf16_keeps_its_own():
    h200 = _profile()
    fast = engine_defaults(h200, "fp8", "fp8")
    assert (fast.max_num_batched_tokens, fast.max_num_seqs, fast.cuda_graph_max_batch_size) == THROUGHPUT_DEFAULTS
    assert fast.max_num_seqs >= 512 and fast.cuda_graph_max_batch_size == 512
    assert "throughput mode" in fast.reason and "SM 9.0" in fast.reason
    plain = engine_defaults(h200)
    assert (plain.max_num_batched_tokens, plain.max_num_seqs, plain.cuda_graph_max_batch_size) == (8192, 256, 256)
    assert engine_defaults(h200, "fp8", "auto") == plain


def test_engine_config_takes_throughput_defaults_logs_them_and_flags_override(caplog):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    chosen = engine_defaults(_profile(), "fp8", "fp8")
    with caplog.at_level(logging.INFO, logger="sits.runtime.hardware"):
        config = engine_config_from_args(parser.parse_args(["--device", "cpu"]), chosen)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (512, 16384)
    assert config.cuda_graph_max_batch_size == 512
    assert any("throughput mode" in r.getMessage() and "CUDA graphs up to batch 512" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sits.runtime.hardware"):
        config = engine_config_from_args(parser.parse_args(["--device", "cpu", "--max-num-seqs", "300"]), chosen)
    assert config.scheduler.max_num_seqs == 300 and config.cuda_graph_max_batch_size == 512
    assert any("overridden: --max-num-seqs 300" in r.getMessage() for r in caplog.records)


def test_the_decode_latency_budget_is_on_for_interactive_gpus_off_in_throughput_mode_and_flags_win():
    h200 = _profile()
    plain = engine_defaults(h200)
    assert (plain.max_prefill_tokens_with_decodes, plain.prefill_cap_min_decodes) == (768, 64)
    fast = engine_defaults(h200, "fp8", "fp8")
    assert fast.max_prefill_tokens_with_decodes == 0  # a throughput batch's own prefill is the work
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--device", "cpu"]), plain)
    assert config.scheduler.prefill_cap_with_decodes == 768 and config.scheduler.prefill_cap_min_decodes == 64
    config = engine_config_from_args(parser.parse_args(["--device", "cpu", "--max-prefill-tokens-with-decodes", "0",
                                                        "--prefill-cap-min-decodes", "8"]), plain)
    assert config.scheduler.prefill_cap_with_decodes is None and config.scheduler.prefill_cap_min_decodes == 8
