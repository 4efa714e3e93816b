"""The default KV budget on 8 / 16 / 24 / 64 GB Macs (plan_memory with MLX's device info injected)."""

import mlx.core as mx
import pytest

from macinfer.engine.config import EngineConfig, default_kv_memory, plan_memory
from macinfer.kv.paged_cache import LayerSpec

GiB = 1 << 30
# (memory, recommended working set) as Metal reports them: 2/3 of memory up to 32 GB, 3/4 above.
HOSTS = {8: (8 * GiB, 8 * GiB * 2 // 3), 16: (16 * GiB, 16 * GiB * 2 // 3), 24: (24 * GiB, 24 * GiB * 2 // 3),
         64: (64 * GiB, 64 * GiB * 3 // 4)}
# SmolLM2-135M (30 layers x 3 KV heads x 64, float16) and an 8B model in 4 bits (32 x 8 x 128)
MODELS = {"small": (30 * [LayerSpec(3, 64, 64, None, mx.float16)], 100 << 20),
          "8b-4bit": (32 * [LayerSpec(8, 128, 128, None, mx.float16)], int(4.5 * GiB))}


def device(gb):
    memory, working_set = HOSTS[gb]
    return {"memory_size": memory, "max_recommended_working_set_size": working_set}


@pytest.mark.parametrize("gb,want_gib", [(8, 1), (16, 2), (24, 3), (64, 8)])
def test_small_model_gets_an_eighth_of_memory(gb, want_gib):
    specs, weights = MODELS["small"]
    plan = plan_memory(EngineConfig(), specs, 8192, weights, "llama", device=device(gb))
    assert plan.kv_budget == want_gib * GiB
    assert plan.bytes_per_token == 30 * 3 * 2 * 64 * 2
    assert plan.num_blocks == want_gib * GiB // plan.bytes_per_block


@pytest.mark.parametrize("gb", [8, 16, 24, 64])
def test_margin_is_left_in_the_working_set(gb):
    """weights + KV + margin (1 GiB or a tenth of the working set) fit the recommended working set,
    or the KV is the 256 MiB floor when the weights leave no room (an 8B model on an 8 GB Mac)."""
    memory, working_set = HOSTS[gb]
    specs, weights = MODELS["8b-4bit"]
    kv = plan_memory(EngineConfig(), specs, 8192, weights, "llama", device=device(gb)).kv_budget
    margin = max(GiB, working_set // 10)
    assert kv <= memory // 8
    if working_set - weights - margin > 256 << 20:
        assert weights + kv + margin <= working_set
        assert kv == min(working_set - weights - margin, memory // 8)
    else:
        assert kv == 256 << 20 and gb == 8


def test_without_metal_sizes_the_default_is_1_gib_and_kv_memory_wins():
    assert default_kv_memory(10 << 20, device={}) == GiB
    specs, weights = MODELS["small"]
    plan = plan_memory(EngineConfig(kv_memory="6GiB"), specs, 8192, weights, "llama", device=device(8))
    assert plan.kv_budget == 6 * GiB  # an explicit budget is taken as given
