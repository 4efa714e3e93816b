"""Tiny random models that think and call tools as real families do: their tokenizers carry the
families' special tokens and published chat templates (tests/chat_templates/, licences there).

    qwen3        `<think>` ... `</think>` and Hermes-style `<tool_call>` JSON (mlx-lm: json_tools)
    qwen3_coder  Qwen3-Coder's XML tool calls (`<function=NAME>`, `<parameter=KEY>`; mlx-lm: qwen3_coder)
    r1_distill   DeepSeek-R1-Distill: the template opens the thought in the prompt; no tool parser
                 in mlx-lm, so tools take the generic JSON format
    gpt_oss      gpt-oss's harmony channels (analysis / commentary / final)

The harmony family is read with openai-harmony, whose o200k vocabulary file is rebuilt here from
the `quicktok-v1` wheel's copy of it (harmony checks the file's SHA-256 itself).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import struct
from pathlib import Path

from tiny import build_tiny_model

TEMPLATES = Path(__file__).parent / "chat_templates"

FAMILIES = {
    "qwen3": dict(
        template="Qwen-Qwen3-0.6B.jinja",
        special_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos_token="<|im_end|>"),
    "qwen3_coder": dict(
        template="Qwen-Qwen3-Coder.jinja",
        special_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos_token="<|im_end|>"),
    "r1_distill": dict(
        template="deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        special_tokens=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                        "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                        "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                        "<｜tool▁output▁end｜>"),
        eos_token="<｜end▁of▁sentence｜>", bos_token="<｜begin▁of▁sentence｜>"),
    "gpt_oss": dict(
        template="openai-gpt-oss-120b.jinja",
        special_tokens=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                        "<|call|>", "<|startoftext|>"),
        eos_token="<|return|>", eos_token_ids=["<|return|>", "<|call|>"]),
}


def build_family_model(out: Path, family: str, seed: int = 0) -> Path:
    spec = dict(FAMILIES[family])
    template = (TEMPLATES / spec.pop("template")).read_text()
    return build_tiny_model(out, "llama", seed=seed, max_position_embeddings=4096,
                            tokenizer={**spec, "chat_template": template})


O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def write_o200k(directory: Path) -> Path:
    """Write o200k_base.tiktoken (tiktoken's format: base64 token, rank) from quicktok-v1's data file.

    quicktok's `o200k.vocab` is: u32 count, then per token u16 length, the bytes, u32 rank.
    """
    spec = importlib.util.find_spec("quicktok")
    data = (Path(spec.origin).parent / "data" / "o200k.vocab").read_bytes()
    (n,), off, ranks = struct.unpack_from("<I", data, 0), 4, []
    for _ in range(n):
        (length,) = struct.unpack_from("<H", data, off)
        token = data[off + 2:off + 2 + length]
        (rank,) = struct.unpack_from("<I", data, off + 2 + length)
        off += 6 + length
        ranks.append((rank, token))
    text = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in sorted(ranks)).encode()
    assert hashlib.sha256(text).hexdigest() == O200K_SHA256, "quicktok's o200k data is not tiktoken's o200k_base"
    path = directory / "o200k_base.tiktoken"
    path.write_bytes(text)
    return path
