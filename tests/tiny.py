"""Tiny random-weight models for tests, built on the spot (nothing downloads).

Each model is written as an mlx-lm directory (config.json, model.safetensors,
tokenizer files) so `mlx_lm.load` and macinfer load it the same way: that is
what makes mlx-lm's own output a valid oracle for ours.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A chat template with tool calling, shaped like Qwen2.5's (mlx-lm infers its json_tools parser
# from "<tool_call>" and "tool_call.name" in it).
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}{% set tool_call = tc.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "Paged attention stores the key value cache in fixed size blocks. "
    "Continuous batching schedules every request at the token level. "
    "Speculative decoding drafts tokens and the target model verifies them. "
    "What is the capital of France? The capital of France is Paris. "
    "Once upon a time there was a little model that wanted to run on a Mac. "
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:'\"()[]{}<>-_+=*/\\|@#$%^&~`\n"
)

# Architecture -> config overrides. All share one tiny shape so tests stay fast.
ARCHS = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2", "attention_bias": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
}


def train_tokenizer(out: Path, vocab_size: int = 320, tool_call: str | None = None,
                    special_tokens: tuple[str, ...] = (), chat_template: str | None = None,
                    eos_token: str = "<|im_end|>", bos_token: str = "<|endoftext|>") -> None:
    """Train a byte-level BPE tokenizer and write it as a HF fast tokenizer.

    tool_call: a whole tool call's text, added as one token (id vocab_size) so a test can force
    it with logit_bias; the chat template then renders tools.
    special_tokens: a real family's marker tokens (`<think>`, harmony's `<|channel|>`, ...), added
        after the trained vocabulary as special tokens, each one id.
    chat_template: the template to carry (default: a ChatML one).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys(["<|endoftext|>", "<|im_start|>", "<|im_end|>", bos_token, eos_token])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    if tool_call is not None:
        tok.add_tokens([tool_call])
    if special_tokens:
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.save(str(out / "tokenizer.json"))
    template = chat_template or (CHAT_TEMPLATE if tool_call is None else TOOLS_CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": bos_token,
                "eos_token": eos_token,
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "chat_template": template,
                "model_max_length": 512,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": eos_token, "bos_token": bos_token})
    )


def build_tiny_model(
    out: Path | str,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tool_call: str | None = None,
    tokenizer: dict | None = None,
    **overrides,
) -> Path:
    """Write a random-weight model of `arch` (see ARCHS) to `out` and return it.

    Weights are float32 and scaled up so greedy decoding is not stuck on one token
    (a flat random model repeats itself, which would make equality tests weak).
    tokenizer: train_tokenizer's family options (special_tokens, chat_template, eos_token,
    bos_token); `eos_token_ids` in it lists every token that ends a reply (the config's list).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = dict(tokenizer or {})
    eos_names = tokenizer.pop("eos_token_ids", None)
    train_tokenizer(out, tool_call=tool_call, **tokenizer)
    tok_json = json.loads((out / "tokenizer.json").read_text())
    vocab = {**tok_json["model"]["vocab"], **{t["content"]: t["id"] for t in tok_json["added_tokens"]}}
    rows = len(tok_json["model"]["vocab"]) + 3 + len(tokenizer.get("special_tokens", ()))  # spare rows hold added tokens
    config = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": hidden_size * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": rows,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": [vocab[t] for t in eos_names] if eos_names else vocab.get(tokenizer.get("eos_token", "<|im_end|>"), 2),
        "bos_token_id": vocab.get(tokenizer.get("bos_token", "<|endoftext|>"), 0),
        "torch_dtype": "float32",
    }
    config.update(ARCHS[arch])
    config.update(overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Larger-than-default init gives peaky, varied logits.
    params = {
        k: (mx.random.normal(v.shape) * (0.02 if v.ndim == 1 and "bias" in k else 0.3)
            if v.ndim > 1 or "bias" in k else v).astype(mx.float32)
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_from_config(out: Path | str, config: dict, seed: int = 0) -> Path:
    """Write a random-weight model of any mlx-lm `config` (e.g. one of tests/arch_configs.json) to `out`.

    The tiny tokenizer above goes with it; the config's vocabulary must cover it. Matrices
    are drawn N(0, 3^2 / fan_in) (varied, peaky logits), vectors keep their init (norms,
    biases, SSM decay terms), everything is float32.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = json.loads(json.dumps(config))
    config.setdefault("eos_token_id", vocab["<|im_end|>"])
    config.setdefault("bos_token_id", vocab["<|endoftext|>"])
    text = config.get("text_config", config)
    if text.get("vocab_size", config.get("vocab_size", 0)) < len(vocab):
        raise ValueError(f"vocab_size {text.get('vocab_size')} < the tokenizer's {len(vocab)}")
    # Some models size their embedding by another key (phixtral: num_vocab); token ids past
    # it are an out-of-range gather, whose output is whatever memory holds.
    for key in ("num_vocab", "n_vocab", "padded_vocab_size"):
        if text.get(key, len(vocab)) < len(vocab):
            raise ValueError(f"{key} {text[key]} < the tokenizer's {len(vocab)}")
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = {}
    for k, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            if v.ndim >= 2:
                fan_in = 1
                for s in v.shape[1:]:
                    fan_in *= s
                v = mx.random.normal(v.shape) * (3 / fan_in ** 0.5)
            v = v.astype(mx.float32)
        params[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=1))
    return out
