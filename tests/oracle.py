"""mlx-lm's own output, the oracle every generation test compares against."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def mlx_lm_load(path: str):
    import mlx_lm

    return mlx_lm.load(path)


def mlx_lm_greedy(path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids from mlx_lm.stream_generate, stopping at EOS like it does."""
    from mlx_lm.generate import stream_generate

    model, tok = mlx_lm_load(str(path))
    out = []
    for r in stream_generate(model, tok, list(prompt_ids), max_tokens=max_tokens):
        if r.finish_reason == "stop":
            break
        out.append(int(r.token))
    return out
