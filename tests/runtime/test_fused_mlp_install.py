"""SITS_FUSED_MLP=1 (runtime/models/fused_mlp.py): a folded decode layer's MLP as one launch, in the model.

The tiny random model with its norms folded (as tests/runtime/test_norm_fold.py installs it), the kernels in Triton's
interpreter on CPU. With the switch on, every layer's MLP at up to 16 rows runs the fused launch and the model
computes what the two launches compute, within the rounding of their other tiles; off, unfolded, or with tiles
that do not divide the model, nothing changes.
"""

from __future__ import annotations

import copy

import pytest

import sits.kernels.fused_mlp as kernel_module
from sits.runtime.models.fused_mlp import FUSED_MLP_ENV, install_fused_mlp
from sits.runtime.models.norm_fold import fold_decoder_norms
from tests.runtime.test_norm_fold import LAYERS, _close, _installed
from tests.runtime.test_small_m_linear import _forward

TINY_CONFIG = {"BLOCK_I": 32, "BLOCK_N": 32, "K_SPLIT": 2, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


@pytest.fixture
def fused_calls(monkeypatch):
    """How many fused launches ran (each one runs)."""
    calls = {"n": 0}
    real = kernel_module._fused_mlp_kernel

    class Counting:
        def __getitem__(self, grid):
            calls["n"] += 1
            return real[grid]

    monkeypatch.setattr(kernel_module, "_fused_mlp_kernel", Counting())
    return calls


def _folded(tmp_path, monkeypatch):
    model = _installed(tmp_path, monkeypatch)
    assert fold_decoder_norms(model)
    return model


@pytest.mark.parametrize(("num_seqs", "tokens_each"), [(1, 1), (4, 2), (16, 1)])
def test_the_fused_mlp_computes_what_the_two_launches_compute(tmp_path, monkeypatch, fused_calls, num_seqs,
                                                              tokens_each):
    model = _folded(tmp_path, monkeypatch)
    expected = _forward(model, num_seqs, tokens_each)
    fused = copy.deepcopy(model)
    monkeypatch.setenv(FUSED_MLP_ENV, "1")
    assert install_fused_mlp(fused, TINY_CONFIG) is not None
    assert all(layer.mlp.fused_decode is not None for layer in fused.model.layers)
    out = _forward(fused, num_seqs, tokens_each)
    assert fused_calls["n"] == LAYERS
    _close(out, expected, 2e-2)


def test_past_16_rows_the_mlp_keeps_its_two_launches(tmp_path, monkeypatch, fused_calls):
    model = _folded(tmp_path, monkeypatch)
    monkeypatch.setenv(FUSED_MLP_ENV, "1")
    assert install_fused_mlp(model, TINY_CONFIG) is not None
    _forward(model, 17, 1)
    assert fused_calls["n"] == 0


def test_where_the_fused_mlp_is_not_installed(tmp_path, monkeypatch):
    model = _installed(tmp_path, monkeypatch)
    monkeypatch.setenv(FUSED_MLP_ENV, "1")
    assert install_fused_mlp(model, TINY_CONFIG) is None  # norms not folded
    assert fold_decoder_norms(model)
    monkeypatch.delenv(FUSED_MLP_ENV)
    assert install_fused_mlp(model, TINY_CONFIG) is None  # off by default
    monkeypatch.setenv(FUSED_MLP_ENV, "1")
    assert install_fused_mlp(model, {**TINY_CONFIG, "BLOCK_I": 256}) is None  # tiles that do not divide 128
    assert not any(hasattr(layer.mlp, "fused_decode") for layer in model.model.layers)
