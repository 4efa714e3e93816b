"""Structured output: every sampled output follows its grammar, under batching, preemption,
chunked prefill and speculation; bad grammars are one line; matchers are released."""

import json
import re

import jsonschema
import pytest

from macinfer.core.grammar import StructuredOutput, apply_masks
from macinfer.core.sampling import SamplingParams
from macinfer.errors import MacinferError
from macinfer.llm import LLM

# Bounded: strings by pattern, integers by range, the array by maxItems; with the bounded JSON
# whitespace (macinfer.core.grammar.JSON_WHITESPACE) every output ends within a few hundred tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "ok", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 400  # > the longest output the schema allows in this tokenizer (whitespace included)


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                          structured=kw.pop("structured", StructuredOutput(json_schema=SCHEMA)), **kw)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return LLM(str(tiny_models("llama")))


def test_json_schema_20_seeds_at_temperature_1_all_valid(tiny):
    outs = tiny.generate(["Describe a user as JSON:"] * 20, [sampled(s) for s in range(20)])
    for s, out in enumerate(outs):
        assert out.finish_reason == "stop", (s, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 10, "the seeds should sample different documents"
    assert not tiny.engine.requests


def test_without_the_grammar_the_model_writes_no_json(tiny):
    """The oracle above is not vacuous: unconstrained, the random model's text is not JSON."""
    outs = tiny.generate(["Describe a user as JSON:"] * 4,
                         [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in range(4)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_regex_choice_and_json_object(tiny):
    kinds = [StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}"), StructuredOutput(choice=["yes", 'no "way"', "über"]),
             StructuredOutput(json_object=True)]
    params = [sampled(s, structured=k, max_tokens=200 if k.json_object else 40) for k in kinds for s in range(4)]
    outs = tiny.generate(["Answer:"] * len(params), params)
    for p, out in zip(params, outs):
        so = p.structured
        if so.regex:
            assert re.fullmatch(so.regex, out.text) and out.finish_reason == "stop", out.text
        elif so.choice:
            assert out.text in so.choice and out.finish_reason == "stop", out.text
        elif out.finish_reason == "stop":  # any JSON object: unbounded, so it may run out of tokens
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.lstrip().startswith("{")


def test_greedy_output_is_the_same_under_preemption_and_chunked_prefill(tiny_models, tiny):
    """Preemption recomputes prompt and output but keeps the matcher; prefill chunks sample nothing."""
    prompts = [f"Request {i}: " + "continuous batching schedules every request. " * (2 + i) for i in range(6)]
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=SCHEMA))
    want = [o.token_ids for o in tiny.generate(prompts, params)]
    # 20 blocks of 16 tokens for 6 requests of ~40-70 prompt tokens: they preempt each other.
    tight = LLM(str(tiny_models("llama")), num_blocks=21, max_num_batched_tokens=32, max_num_seqs=6)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert tight.engine.block_pool.get_num_free_blocks() == tight.engine.block_pool.num_usable_blocks


def test_speculation_drafts_only_for_requests_without_a_grammar(tiny_models, tiny):
    spec = LLM(str(tiny_models("llama")), draft="ngram", adaptive_speculation=False)  # drafts whenever offered
    drafted: dict[str, int] = {}
    verify = spec.engine.runner.verifier

    def spy(group, rows, logits):
        for r in rows:
            drafted[r.seq.request_id] = drafted.get(r.seq.request_id, 0) + r.num_spec_tokens
        return verify(group, rows, logits)

    spec.engine.runner.verifier = spy
    prompt = "the cat sat on the mat. " * 12  # repeats itself: n-gram lookup drafts for free text
    params = [SamplingParams(max_tokens=60, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=SCHEMA))]
    rids = [spec.engine.add_request(spec.encode(prompt), p) for p in params]
    outs = {}
    while spec.engine.has_unfinished():
        for d in spec.engine.step():
            if d.output is not None:
                outs[d.request_id] = d.output
    assert drafted.get(rids[0], 0) > 0, "the free-text request should have been drafted for"
    assert drafted.get(rids[1], 0) == 0
    # Greedy with a grammar: the same tokens as without speculation.
    assert outs[rids[1]].token_ids == tiny.generate([prompt], params[1])[0].token_ids
    jsonschema.validate(json.loads(outs[rids[1]].text), SCHEMA)


def test_matcher_released_on_finish_and_abort(tiny):
    engine = tiny.engine
    done = engine.add_request(tiny.encode("a"), sampled(0))
    gone = engine.add_request(tiny.encode("b"), sampled(1))
    seqs = [engine.requests[done], engine.requests[gone]]
    assert all(s.grammar is not None for s in seqs)
    engine.step()
    engine.abort_request(gone)
    while engine.has_unfinished():
        engine.step()
    assert [s.finish_reason for s in seqs] == ["stop", "abort"]
    assert all(s.grammar is None for s in seqs)


def test_bad_grammars_are_one_line_errors(tiny):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json_schema="{")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput(choice=[])
    for bad in (StructuredOutput(json_schema={"type": "nonsense"}), StructuredOutput(regex="(unclosed"),
                StructuredOutput(grammar="start: undefined_rule")):
        with pytest.raises(MacinferError) as e:
            tiny.generate("x", SamplingParams(structured=bad))
        assert "\n" not in str(e.value) and str(e.value).startswith(bad.kind)
    assert not tiny.engine.requests


def test_the_fallback_engine_refuses_structured_output(tiny_models):
    dense = LLM(str(tiny_models("llama")), engine="mlx-lm")
    with pytest.raises(MacinferError, match="structured output needs the paged engine"):
        dense.generate("x", SamplingParams(structured=StructuredOutput(json_object=True)))


def test_apply_masks_bit_order():
    import mlx.core as mx
    import numpy as np

    V = 70  # 3 words; the last one covers tokens 64..95, past V
    mask = np.zeros((2, 3), dtype=np.int32)
    mask[0, 0] = 1 << 5
    mask[0, 1] = np.int32(-2**31)  # bit 31 of word 1: token 63
    mask[0, 2] = 1 << 6  # token 70: outside the logits, ignored
    mask[1] = -1  # a row without a grammar
    logits = mx.zeros((2, V))
    out = np.array(apply_masks(logits, mask))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [5, 63]
    assert np.isfinite(out[1]).all()
    out3 = np.array(apply_masks(mx.zeros((2, 3, V)), mask))  # verify forwards: position 0 only
    assert np.flatnonzero(np.isfinite(out3[0, 0])).tolist() == [5, 63] and np.isfinite(out3[:, 1:]).all()


def test_cli_json_schema(tiny_models, tmp_path):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    path = tiny_models("llama")
    schema = tmp_path / "user.json"
    schema.write_text(json.dumps(SCHEMA))

    def run(*args):
        return CliRunner().invoke(main, ["run", str(path), "Describe a user", "--json", "--peak-bandwidth", "100",
                                         "-n", str(MAX_TOKENS), *args])

    for seed in range(3):
        r = run("--json-schema", str(schema), "--temp", "1", "--seed", str(seed))
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["finish_reason"] == "stop"
        jsonschema.validate(json.loads(got["text"]), SCHEMA)
    (tmp_path / "bad.json").write_text('{"type": "objec')
    (tmp_path / "wrong.json").write_text('{"type": "nonsense"}')
    for bad, why in (("bad.json", "not valid JSON"), ("wrong.json", "Invalid type"), ("missing.json", "cannot read")):
        r = run("--json-schema", str(tmp_path / bad))
        assert r.exit_code != 0
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: --json-schema {tmp_path / bad}: ") and why in lines[0], r.output
