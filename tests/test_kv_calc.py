"""`macinfer kv`: the seed's KV arithmetic against numbers worked out by hand."""

import json

import pytest
from click.testing import CliRunner

from macinfer import units
from macinfer.perf import kv_calc
from macinfer.cli.main import main

# Llama-2-70B: 80 layers, 64 heads / 8 KV heads, head_dim 8192/64 = 128, float16.
PER_TOKEN = 2 * 80 * 8 * 128 * 2  # = 327,680 bytes
# Its parameters, counted by hand: per layer q,o (8192x8192 each) + k,v (8192x1024 each)
# + MLP 3 x 8192x28672 + 2 norms; untied 32000x8192 embedding and lm_head; final norm.
PARAMS = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 2 * 32000 * 8192 + 8192
WEIGHTS = PARAMS * 2  # float16


def kv(*args):
    return CliRunner().invoke(main, ["kv", *map(str, args)])


def test_llama2_70b_per_token_and_100k_context():
    m = kv_calc.resolve_kv_model("llama-2-70b")
    assert PER_TOKEN == 327_680
    assert PARAMS == 68_976_648_192  # the published 69.0B
    assert m.weight_bytes == WEIGHTS
    r = kv_calc.plan(m, memory=192 * 10**9, contexts=[100_000, 100_001, 4096], concurrency=4)
    assert r["per_token_bytes"] == PER_TOKEN
    at_100k = r["contexts"][0]
    assert at_100k["per_sequence_bytes"] == 32_768_000_000  # "tens of GB per request": 32.8 GB
    assert at_100k["per_server_bytes"] == 4 * 32_768_000_000
    assert r["headroom_bytes"] == 192 * 10**9 - WEIGHTS  # 54.0 GB
    assert at_100k["max_concurrency"] == 1 and not at_100k["fits"]
    # Paging: 100,001 tokens take 6,251 blocks of 16 = 100,016 slots.
    assert r["contexts"][1]["reserved_tokens"] == 100_016
    assert r["contexts"][1]["block_waste_bytes"] == 15 * PER_TOKEN
    assert r["contexts"][2]["max_concurrency"] == (192 * 10**9 - WEIGHTS) // (4096 * PER_TOKEN)  # 40
    # One sequence's KV equals the weights at 137,953,296,384 / 327,680 = 421,000.05 -> 421,001
    # tokens (far past its 4k context); four sequences at a quarter of it each.
    assert WEIGHTS == 137_953_296_384
    assert r["crossover_context"] == 421_001
    assert r["crossover_context_at_concurrency"] == 105_251


@pytest.mark.parametrize("bits, per_value", [(32, 4), (16, 2), (8, 1 + 4 / 64), (4, 0.5 + 4 / 64)])
def test_kv_quantisation_pays_scales_and_biases(bits, per_value):
    m = kv_calc.resolve_kv_model("llama-2-70b")
    r = kv_calc.plan(m, 10**12, [1000], kv_bits=bits, group_size=64, block_size=0)
    assert r["per_token_bytes"] == 2 * 80 * 8 * 128 * per_value  # 8-bit: 174,080; 4-bit: 92,160
    assert r["contexts"][0]["per_sequence_bytes"] == 1000 * r["per_token_bytes"]


def test_model_directory_measures_weight_files_and_matches_loader(tiny_models):
    from macinfer.modelio.loader import load_model

    path = tiny_models("llama")
    m = kv_calc.resolve_kv_model(str(path))
    _, _, info = load_model(str(path))
    # tiny llama: 2 layers x 2 KV heads x head_dim 64/4 = 16, float32 -> 2*2*2*16*4 = 512 bytes/token.
    assert kv_calc.kv_bytes_per_token(m) == info.kv_bytes_per_token == 512
    assert m.weight_bytes == (path / "model.safetensors").stat().st_size
    assert m.context_length == 512 and m.weights_source == "files"


def test_parsing_units():
    assert units.parse_bytes("64GB") == 64 * 10**9
    assert units.parse_bytes("24GiB") == 24 * 2**30
    assert units.parse_bytes("1.5 gb") == 1_500_000_000
    assert kv_calc.parse_tokens("8k") == 8192 and kv_calc.parse_tokens("128K") == 131072
    assert kv_calc.parse_tokens("100000") == 100_000
    assert kv_calc.fmt_bytes(32_768_000_000) == "32.8 GB" and kv_calc.fmt_bytes(327_680) == "328 KB"
    for bad in ("lots", "12XB", ""):
        with pytest.raises(kv_calc.MacinferError):
            units.parse_bytes(bad)
    with pytest.raises(kv_calc.MacinferError):
        kv_calc.parse_tokens("0")


def test_cli_json_and_table():
    r = kv("llama-2-70b", "--memory", "192GB", "--context", "8k,100000", "-c", "4", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["per_token_bytes"] == PER_TOKEN
    assert [c["context"] for c in rep["contexts"]] == [8192, 100_000]
    r = kv("llama-2-70b", "--memory", "192GB", "--context", "100000", "--kv-bits", "8")
    assert r.exit_code == 0, r.output
    assert "174,080 bytes/token" in r.output and "headroom" in r.output and "max concurrency" in r.output


@pytest.mark.parametrize("args, msg", [
    (["llama-2-70b", "--memory", "lots"], "as a size"),
    (["llama-2-70b", "--context", "8q"], "token count"),
    (["/no/such/model"], "no such model"),
])
def test_cli_bad_input_is_one_line(args, msg):
    r = kv(*args)
    assert r.exit_code != 0
    assert msg in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
