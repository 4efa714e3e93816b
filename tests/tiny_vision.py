"""Tiny random-weight vision-language models for tests, built on the spot (nothing downloads).

Each is written as mlx-vlm writes a converted checkpoint (config.json, model.safetensors with
mlx-vlm's parameter names, tokenizer files, the processor's configs), so mlx-vlm's own loader and
generation run it as the oracle, and mlx-lm loads its language model as it loads a real one.

The vision towers' shapes are those of mlx-vlm's own tests (mlx_vlm/tests/test_models.py,
`test_<family>_input_embeddings`: one layer, hidden size 16, 28x28 images, 14-pixel patches);
the language models are a little wider (hidden 64, two layers) so greedy output varies instead
of repeating one token, which makes token-for-token equality a strong test. mlx-vlm is
MIT-licensed:

    MIT License. Copyright (c) 2024 Prince Canuma. Permission is hereby granted, free of charge,
    to any person obtaining a copy of this software and associated documentation files (the
    "Software"), to deal in the Software without restriction, including without limitation the
    rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the
    Software, and to permit persons to whom the Software is furnished to do so, subject to the
    following conditions: The above copyright notice and this permission notice shall be included
    in all copies or substantial portions of the Software. THE SOFTWARE IS PROVIDED "AS IS",
    WITHOUT WARRANTY OF ANY KIND.

The chat templates keep each family's way of writing an image part (Gemma 3's
<start_of_image>, Mistral Small 3.1's [IMG], LFM2-VL's <image>) around the im_start turns of
tests/tiny.py's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny import train_tokenizer

FAMILIES = ("gemma3", "mistral3", "lfm2-vl")


def _template(image: str) -> str:
    return ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for item in message['content'] %}{% if item['type'] == 'image' %}" + image +
            "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _gemma3(vocab: dict, V: int) -> tuple[dict, dict, dict]:
    config = {
        "model_type": "gemma3", "vocab_size": V, "hidden_size": 64, "mm_tokens_per_image": 4,
        "image_token_index": vocab["<image_soft_token>"], "boi_token_index": vocab["<start_of_image>"],
        "eoi_token_index": vocab["<end_of_image>"], "pad_token_id": vocab["<|endoftext|>"],
        "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
                        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": V, "mm_tokens_per_image": 4,
                        "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
                        "max_position_embeddings": 512},
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 16,
                          "intermediate_size": 32, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                          "num_channels": 3},
    }
    preprocessor = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                    "do_resize": True, "size": {"height": 28, "width": 28}, "do_rescale": True,
                    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                    "do_convert_rgb": True, "do_pan_and_scan": False, "resample": 2}
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": 4}
    return config, preprocessor, processor


def _mistral3(vocab: dict, V: int) -> tuple[dict, dict, dict]:
    config = {
        "model_type": "mistral3", "image_token_index": vocab["[IMG]"], "spatial_merge_size": 2,
        "vision_feature_layer": -1, "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
        "text_config": {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                        "vocab_size": V, "rope_theta": 10000.0, "max_position_embeddings": 512,
                        "tie_word_embeddings": False, "layer_types": ["full_attention"] * 2},
        "vision_config": {"model_type": "pixtral", "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                          "num_attention_heads": 2, "image_size": 56, "patch_size": 14, "num_channels": 3,
                          "head_dim": 8, "rope_theta": 10000.0},
    }
    preprocessor = {"image_processor_type": "PixtralImageProcessor", "processor_class": "Mistral3Processor",
                    "do_resize": True, "size": {"longest_edge": 56}, "patch_size": 14, "do_rescale": True,
                    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
                    "image_std": [0.5] * 3, "do_convert_rgb": True, "resample": 3}
    processor = {"processor_class": "Mistral3Processor", "patch_size": 14, "spatial_merge_size": 2,
                 "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    return config, preprocessor, processor


def _lfm2_vl(vocab: dict, V: int) -> tuple[dict, dict, dict]:
    config = {
        "model_type": "lfm2-vl", "image_token_index": vocab["<image>"], "downsample_factor": 2,
        "projector_hidden_size": 32, "projector_hidden_act": "gelu", "projector_bias": True, "vocab_size": V,
        "text_config": {"model_type": "lfm2", "vocab_size": V, "hidden_size": 64, "num_hidden_layers": 3,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128,
                        "block_multiple_of": 8, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
                        "intermediate_size": 128, "conv_dim": 64, "conv_dim_out": 64, "rope_theta": 10000.0,
                        "layer_types": ["conv", "full_attention", "conv"]},
        "vision_config": {"model_type": "lfm2_vl", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "num_patches": 16},
    }
    preprocessor = {"image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor",
                    "encoder_patch_size": 14, "downsample_factor": 2, "min_image_tokens": 1, "max_image_tokens": 4,
                    "tile_size": 28, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2,
                    "do_image_splitting": False, "use_thumbnail": False}
    processor = {"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True,
                 "do_image_splitting": False, "use_thumbnail": False}
    return config, preprocessor, processor


SPECS = {
    "gemma3": (_gemma3, ["<start_of_image>", "<end_of_image>", "<image_soft_token>"], "<start_of_image>",
               {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}),
    "mistral3": (_mistral3, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]", None),
    "lfm2-vl": (_lfm2_vl, ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"], "<image>", None),
}


def _bench_gemma3(vocab: dict, V: int) -> tuple[dict, dict, dict]:
    """A larger gemma3 for scripts/bench/vision.py: a 224-pixel, 4-layer tower (256 patches pooled to 64
    image tokens) in front of a 4-layer, 256-wide language model."""
    config, preprocessor, processor = _gemma3(vocab, V)
    config.update(hidden_size=256, mm_tokens_per_image=64)
    config["text_config"].update(hidden_size=256, num_hidden_layers=4, intermediate_size=1024, head_dim=64,
                                 query_pre_attn_scalar=64, mm_tokens_per_image=64, sliding_window=512,
                                 max_position_embeddings=2048)
    config["vision_config"].update(num_hidden_layers=4, hidden_size=384, intermediate_size=1536,
                                   num_attention_heads=6, image_size=224)
    preprocessor["size"] = {"height": 224, "width": 224}
    processor["image_seq_length"] = 64
    return config, preprocessor, processor


def build_tiny_vlm(out: Path | str, family: str = "gemma3", seed: int = 0, bench: bool = False) -> Path:
    """Write a random-weight vision-language model of `family` (FAMILIES) to `out` and return it.

    bench: gemma3's larger shape for scripts/bench/vision.py (`_bench_gemma3`).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs
    from tokenizers import Tokenizer

    make, specials, placeholder, named = SPECS[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = _template(placeholder)
    if named:
        tok_config["extra_special_tokens"] = named
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config, preprocessor, processor = (_bench_gemma3 if bench else make)(vocab, len(vocab))
    config.update(eos_token_id=vocab["<|im_end|>"], bos_token_id=vocab["<|endoftext|>"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    (out / "processor_config.json").write_text(json.dumps(processor))

    module, _ = get_model_and_args(config)
    model_config = update_module_configs(module.ModelConfig.from_dict(config), module, config,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    params = {}
    for k, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            if v.ndim >= 2:  # small embeddings, wider matrices: varied, peaky logits
                fan_in = 1
                for s in v.shape[1:]:
                    fan_in *= s
                v = mx.random.normal(v.shape) * ((0.1 if "embed_tokens" in k else 1.5) / fan_in ** 0.5)
            elif "norm" in k and "language_model" in k:
                v = mx.random.normal(v.shape) * 0.5
            v = v.astype(mx.float32)
        params[k] = v
    if family == "gemma3":  # Gemma ties its head to the embedding (mlx-vlm copies it; mlx-lm ties it)
        params.pop("language_model.lm_head.weight", None)
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    return out


def write_images(out: Path | str, n: int = 3, seed: int = 0) -> list[Path]:
    """n random RGB PNG images of a few sizes (the processors resize them) in `out`."""
    import numpy as np
    from PIL import Image

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        p = out / f"image{i}.png"
        Image.fromarray(rng.integers(0, 255, (40 + 9 * i, 50 - 4 * i, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths
