"""SamplingParams is the one check of sampling values the CLI, the server and the Python API share:
every bad value is a ValueError whose message starts with the field's name, never a TypeError."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from macinfer.cli.main import main
from macinfer.core.sampling import MAX_STOP_STRINGS, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", True),
    ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_p", None), ("top_p", "x"), ("min_p", -1),
    ("min_p", float("nan")), ("min_p", [1]), ("top_k", -1), ("top_k", 1.0), ("top_k", True),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2.0), ("seed", -1), ("seed", 2**64), ("seed", True),
    ("seed", 1.5), ("stop", [1]), ("stop", 5), ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop_token_ids", ["a"]), ("stop_token_ids", [-1]), ("stop_token_ids", 3),
])
def test_bad_value_names_its_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert msg.split(" ", 1)[0] == field and "\n" not in msg and len(msg) < 160, msg


def test_good_values_are_normalised():
    p = SamplingParams(temperature=0.5, top_p=1, min_p=0, top_k=np.int64(3), seed=2**64 - 1, max_tokens=1,
                       stop="END", stop_token_ids=(np.int32(2), 5))
    assert p.stop == ["END"] and p.stop_token_ids == [2, 5] and type(p.stop_token_ids[0]) is int
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop=["a", "", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=["x"] * MAX_STOP_STRINGS).stop == ["x"] * MAX_STOP_STRINGS


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "seed must be an integer from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "seed must be an integer from 0 to 2**64 - 1"),
    (["--stop", "a"] * (MAX_STOP_STRINGS + 1), "stop holds 17 strings"),
])
def test_cli_uses_the_same_check(args, message):
    """Refused before the model is loaded (the model path does not exist), in one line."""
    r = CliRunner().invoke(main, ["run", "/no/such/model", "hi", *args])
    assert r.exit_code != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_cli_stop_string_ends_the_reply(tiny_models):
    path = tiny_models("llama")
    base = ["run", str(path), "Paged attention stores", "--json", "--no-chat-template", "-n", 24,
            "--peak-bandwidth", 100]
    full = json.loads(CliRunner().invoke(main, list(map(str, base))).stdout.strip().splitlines()[-1])["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    r = CliRunner().invoke(main, list(map(str, base + ["--stop", stop])))
    got = json.loads(r.stdout.strip().splitlines()[-1])["text"]
    assert got == full[:full.index(stop)]
