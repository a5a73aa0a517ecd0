"""`sits bench`: the table and JSON it prints, its peer on the same weights, its roofline and its flag errors.

On a CPU the benchmark runs a tiny random Llama with transformers beside it; the GPU figures come from
benchmarks/gpu_engine_run.sh (recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.cli import main
from sits.runtime.commands import bench
from sits.runtime.commands.bench_peer import transformers_model
from sits.runtime.commands.bench_report import percentile, roofline
from sits.runtime.commands.static_peer import StaticCacheDecoder, greedy_step
from sits.runtime.engine.cuda_graphs import decode_batch_sizes
from sits.runtime.engine.request import SamplingParams
from sits.runtime.hardware import CPU_DEFAULTS, GpuProfile, engine_defaults
from sits.runtime.models.presets import preset_config
from sits.runtime.models.random_model import TokenIdTokenizer, random_loaded_model
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata


def test_bench_prints_sits_beside_transformers_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--config", "tiny", "--batch", "3", "--input-len", "12", "--output-len", "5",
                 "--device", "cpu", "--log-level", "warning", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| transformers" in table and "| SITS float32, torch attention, eager |" in table
    assert "x |" in table  # the ratio column
    record = json.loads(out.read_text())
    sits, peer = record["results"][0], record["peer"]
    assert sits["output_tokens"] == peer["output_tokens"] == 15
    assert sits["prompt_tokens"] == 36 and sits["measured"] and peer["measured"]
    assert sits["ratio_vs_peer"] == pytest.approx(sits["output_tok_s"] / peer["output_tok_s"])
    assert 0 < sits["ttft_p50_s"] <= sits["seconds"] and sits["itl_p50_s"] > 0
    assert record["setup"]["max_num_seqs"] == 3 and record["roofline"] is None  # no roofline on a CPU


def test_bench_counts_the_preemptions_of_its_timed_run(capsys):
    """Issue 14's "preemption stays rare" is read from this note: a cache too small for the batch must show it."""
    common = ["bench", "--config", "tiny", "--batch", "4", "--input-len", "12", "--output-len", "20", "--device",
              "cpu", "--log-level", "warning", "--peer", "none", "--block-size", "4", "--no-enable-prefix-caching"]
    assert main([*common, "--num-blocks", "40"]) == 0
    assert "; preemptions: 0" in capsys.readouterr().out  # 4 x 32 tokens fit in 40 blocks of 4
    assert main([*common, "--num-blocks", "12"]) == 0  # 48 tokens for 4 x 32: sequences take turns
    preempted = int(capsys.readouterr().out.split("; preemptions: ")[1].split()[0])
    assert preempted > 0


def test_the_timed_engine_sends_deltas_and_decodes_unless_told_not_to(capsys):
    """The timed engine decodes text by default (vLLM's offline benchmark does) or not (--no-detokenize: the
    engine process's mode, TensorRT-LLM's count); either way its snapshots carry each step's deltas only, so a
    long output's steps copy nothing that grows with it."""
    common = ["bench", "--config", "tiny", "--batch", "2", "--input-len", "8", "--output-len", "6", "--device",
              "cpu", "--log-level", "warning", "--peer", "none"]
    assert main(common) == 0
    assert "| SITS float32, torch attention, eager |" in capsys.readouterr().out
    assert main([*common, "--no-detokenize"]) == 0
    assert "| SITS float32, torch attention, eager, token ids only |" in capsys.readouterr().out
    for flag, decodes in (("--no-detokenize", False), ("--detokenize", True)):
        parser = argparse.ArgumentParser()
        bench.add_bench_arguments(parser)
        args = parser.parse_args(["--config", "tiny", "--device", "cpu", "--output-len", "6", flag])
        config = bench.build_config(args)
        engine = bench.new_engine(args, bench.load(args, config), config)
        assert bench.run_engine(engine, [[5, 6, 7, 8]], 6, "t").output_tokens == 6
        engine.add_request("last", [5, 6, 7, 8], SamplingParams(max_tokens=3, min_tokens=3))
        snapshots = []
        while engine.has_unfinished_requests():
            snapshots += engine.step()
        completions = [s.outputs[0] for s in snapshots if s.outputs]
        assert sum(len(c.token_ids_delta) for c in completions) == 3
        assert all(not c.token_ids and not c.text for c in completions)  # no cumulative copies
        assert bool("".join(c.text_delta for c in completions)) is decodes


def test_bench_measures_both_peers_in_the_same_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--config", "tiny", "--batch", "2", "--input-len", "10", "--output-len", "6", "--device",
                 "cpu", "--log-level", "warning", "--peer", "transformers,compiled", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| vs transformers | vs static cache |" in table
    assert "| PyTorch static cache (eager: no CUDA graphs on the CPU) |" in table
    assert ", ITL " in table  # the ITL ratio beside each output tok/s ratio
    record = json.loads(out.read_text())
    transformers, static = record["peers"]
    assert record["peer"]["system"] == transformers["system"] and transformers["system"].startswith("transformers")
    assert static["output_tokens"] == record["results"][0]["output_tokens"] == 12 and static["itl_p50_s"] > 0
    ratios = record["results"][0]["ratios"]
    assert set(ratios) == {transformers["system"], static["system"]}
    sits = record["results"][0]
    assert ratios[static["system"]]["itl"] == pytest.approx(static["itl_p50_s"] / sits["itl_p50_s"])


@pytest.mark.parametrize("value", ["tensorrt", "compiled,compiled", ",", "none,compiled"])
def test_an_unknown_peer_is_a_one_line_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--config", "tiny", "--device", "cpu", "--peer", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "expected none or some of transformers, compiled" in err and len(err.splitlines()) == 1


@torch.inference_mode()
def test_the_static_cache_peer_computes_sits_logits():
    """The compiled peer's decoder on SITS's own weights: prefill and each decode step give the logits SITS gives
    over the same tokens (float32, CPU), so the two systems are timed on the same function."""
    loaded = random_loaded_model(preset_config("tiny"), TorchAttentionBackend(), "cpu", torch.float32, seed=4)
    tokens = list(range(3, 40))
    cache = PagedKVCache(loaded.model, 4, 16)
    positions, metadata, _ = build_metadata(cache, [(PagedSequence(tokens), len(tokens))], torch.device("cpu"))
    ours = loaded.model.compute_logits(loaded.model(torch.tensor(tokens), positions, cache.caches, metadata))
    decoder = StaticCacheDecoder(loaded.model, 2, 48)
    prompt = torch.tensor([tokens[:30]] * 2)
    torch.testing.assert_close(decoder.prefill(prompt), ours[29].expand(2, -1), rtol=1e-5, atol=1e-5)
    for i in range(30, len(tokens)):
        logits = decoder.decode(torch.tensor([tokens[i]] * 2), torch.tensor([i]))
        torch.testing.assert_close(logits, ours[i].expand(2, -1), rtol=1e-5, atol=1e-5)


def test_the_static_cache_decode_step_traces_as_one_graph():
    """torch.compile traces the decode step whole (fullgraph: no graph break, which on the GPU would split the CUDA
    graph), and the traced step picks the eager step's tokens."""
    loaded = random_loaded_model(preset_config("tiny"), TorchAttentionBackend(), "cpu", torch.float32, seed=5)
    prompt = torch.tensor([[5, 9, 11, 2, 7, 3]] * 3)
    picks = []
    for traced in (False, True):
        decoder = StaticCacheDecoder(loaded.model, 3, 12)
        step = greedy_step(decoder, False)
        if traced:
            step = torch.compile(step, backend="eager", fullgraph=True)
        with torch.inference_mode():
            tokens, out = decoder.prefill(prompt).argmax(-1), []
            for position in range(6, 11):
                tokens = step(tokens, torch.tensor([position]))
                out.append(tokens)
        picks.append(torch.stack(out, 1))
    assert torch.equal(picks[0], picks[1])


def test_a_given_peer_figure_is_marked_as_not_measured(capsys):
    assert main(["bench", "--config", "tiny", "--batch", "2", "--input-len", "8", "--output-len", "3",
                 "--device", "cpu", "--log-level", "warning", "--peer-output-tok-s", "100"]) == 0
    assert "| transformers generate (figure from an earlier run) | 0.06 | 100 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--config", "tiny", "--model", "/nowhere"], "exactly one of --config NAME"),
    (["--config", "gpt-5"], "unknown model config 'gpt-5'; known: llama-3-8b"),
    (["--config", "tiny", "--batch", "0"], "--batch must be positive"),
    (["--model", "/does/not/exist"], "does not exist"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("sits bench: error:")


@torch.inference_mode()
def test_transformers_gets_the_very_same_weights():
    loaded = random_loaded_model(preset_config("tiny"), TorchAttentionBackend(), "cpu", torch.float32, seed=4)
    hf = transformers_model(loaded.model, torch.device("cpu"), torch.float32)
    tokens = list(range(3, 40))
    cache = PagedKVCache(loaded.model, 4, 16)
    positions, metadata, _ = build_metadata(cache, [(PagedSequence(tokens), len(tokens))], torch.device("cpu"))
    ours = loaded.model.compute_logits(loaded.model(torch.tensor(tokens), positions, cache.caches, metadata))
    theirs = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_roofline_is_the_one_baselines_describes():
    floor = roofline(preset_config("llama-3-8b"), int(16.06e9), 32, 2048, 512, 782e12, 4.29e12)
    assert floor.seconds == pytest.approx(4.4, rel=0.02)  # BASELINES.md: 4.4 s, ~3,710 output tok/s
    assert 16384 / floor.seconds == pytest.approx(3710, rel=0.02)
    assert roofline(preset_config("llama-3-8b"), int(16.06e9), 1, 2048, 1, 782e12, 4.29e12).decode_s == pytest.approx(
        3.74e-3 + 2048 * 131072 / 4.29e12, rel=0.01)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([7.0], 99) == 7.0


def test_hardware_defaults_and_graph_buckets():
    h200 = GpuProfile("NVIDIA H200", "H200", 141 << 30, 139 << 30, 4.29e12, 785e12, 1430e12, 132)
    small = GpuProfile("NVIDIA L4", "other", 24 << 30, 22 << 30, 0.3e12, 120e12, None, 58)
    assert (engine_defaults(h200).max_num_batched_tokens, engine_defaults(h200).max_num_seqs) == (8192, 256)
    assert engine_defaults(small).max_num_seqs == 64 and "NVIDIA L4" in engine_defaults(small).reason
    assert engine_defaults(None) is CPU_DEFAULTS
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_batch_sizes(256)[-3:] == [224, 240, 256] and decode_batch_sizes(30)[-1] == 30
    assert decode_batch_sizes(256, largest=12) == [1, 2, 4, 8, 12]


def test_token_id_tokenizer_round_trips():
    tokenizer = TokenIdTokenizer(100, eos_token_ids=[2])
    assert tokenizer.decode([5, 2, 17]) == " 5 17" and tokenizer.encode(" 5 17") == [5, 17]
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.encode("100")
