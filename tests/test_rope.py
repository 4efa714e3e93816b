"""SharedRoPE (macinfer.kv.rope): bit-identical to mx.fast.rope, installed only where exact."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step

from macinfer.engine.llm_engine import LLMEngine
from macinfer.kv.rope import SharedRoPE, _angles, _apply, install_shared_rope, rotation_matches
from macinfer.core.sampling import SamplingParams


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64)])
def test_rotation_is_bit_identical(dtype, traditional, dims, head_dim):
    assert rotation_matches((dims, traditional, 10000.0, 1.0, None), dtype, head_dim)
    freqs = mx.array([1.5 ** i for i in range(dims // 2)])  # Llama3RoPE passes freqs instead of a base
    assert rotation_matches((dims, traditional, None, 1.0, freqs), dtype, head_dim)


def test_per_row_offsets_and_prefill_lengths():
    args = (64, False, 100000.0, 1.0, None)
    x = mx.random.normal((4, 9, 7, 64), key=mx.random.key(1))
    offsets = mx.array([0, 17, 300, 8191], dtype=mx.int32)
    want = mx.fast.rope(x, 64, traditional=False, base=100000.0, scale=1.0, offset=offsets)
    assert mx.array_equal(_apply(x, _angles(4, 7, args, offsets, x.dtype), args, {}), want).item()


def test_install_swaps_plain_ropes_once_and_others_still_use_the_original(load):
    model, _ = load("llama")
    n = install_shared_rope(model)
    ropes = [m for _, m in model.named_modules() if isinstance(m, SharedRoPE)]
    assert n == len(model.layers) == len(ropes)
    assert install_shared_rope(model) == n  # idempotent: no SharedRoPE inside a SharedRoPE
    assert not any(isinstance(r.inner, SharedRoPE) for r in ropes)
    # Outside an engine forward (mlx-lm's own KVCache) the original module runs.
    r = ropes[0]
    x = mx.random.normal((1, 4, 3, r.inner.dims))
    assert mx.array_equal(r(x, offset=5), r.inner(x, offset=5)).item()


def test_engine_with_shared_rope_matches_mlx_lm(load):
    model, tok = load("llama")
    engine = LLMEngine(model, tok, None, num_blocks=64, block_size=4, max_model_len=256)
    assert any(isinstance(m, SharedRoPE) for _, m in model.named_modules())
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15, 16]]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True), request_id=str(p[0]))
    outs = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.output:
                outs[d.request_id] = d.output.token_ids
    for p in prompts:
        want = [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=12)]
        assert outs[str(p[0])] == want


def test_not_installed_off_cpu(monkeypatch, load):
    model, _ = load("llama", seed=7)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu))
    assert install_shared_rope(model) == 0
    assert not any(isinstance(m, SharedRoPE) for _, m in model.named_modules())
    assert isinstance(model.layers[0].self_attn.rope, nn.RoPE)
