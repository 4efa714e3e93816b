"""A model type the paged engine refuses and mlx-lm runs exactly: for the last-resort engine's tests.

Every architecture of the installed mlx-lm now pages (or, minimax_m3_vl, falls back and differs
from mlx-lm's single stream in mlx-lm's own batching too), so the fallback is tested on this one:
llama whose attention mixes two softmax temperatures over the same keys, two sdpa calls per layer
and one cache, which the engine's probe cannot pair with a layer. Registered in-process as
mlx_lm.models.llama_twice (mlx-lm imports a model type's module by name), so only in-process
callers (CliRunner, LLM, the server in a thread) can load it.
"""

from __future__ import annotations

import shutil
import sys
import types

import mlx_lm.models.llama as llama
from mlx_lm.models.base import scaled_dot_product_attention

NAME = "llama_twice"


class Attention(llama.Attention):
    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        # The module's own name, looked up per call: the engine's probe patches it here.
        sharp = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        soft = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale / 2, mask=mask)
        return self.o_proj((0.5 * (sharp + soft)).transpose(0, 2, 1, 3).reshape(B, L, -1))


class Model(llama.Model):
    def __init__(self, args):
        super().__init__(args)
        for layer in self.model.layers:
            layer.self_attn.__class__ = Attention


def register() -> None:
    """Make model_type "llama_twice" loadable by mlx-lm in this process."""
    name = f"mlx_lm.models.{NAME}"
    if name not in sys.modules:
        mod = types.ModuleType(name)
        mod.Model, mod.ModelArgs = Model, llama.ModelArgs
        sys.modules[name] = mod


def build(src, dst):
    """A copy of the tiny llama at `src` (tests/tiny.py) as model type llama_twice, registered."""
    import json

    register()
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "model_type": NAME}))
    return dst
