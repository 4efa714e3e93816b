"""Structured output inside pipelined steps: a row with a grammar is launched with the rest of the
batch but sampled once the step before is read back (its mask needs that token), and the next step
takes its id as input. Outputs must be exactly those of the synchronous engine, and mlx-lm's for
free greedy rows, whatever finishes, arrives or is aborted while steps are in flight. And a server
builds the grammar engine's tokenizer before it serves."""

from __future__ import annotations

import json
import re

import jsonschema

from macinfer.core.grammar import StructuredOutput
from macinfer.core.sampling import SamplingParams
from macinfer.engine.llm_engine import LLMEngine
from test_engine import assert_all_free, oracle, run

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{2}-[a-z]{2,3}"


def _workload():
    """Grammar rows (greedy, seeded, logprobs + penalty, late, aborted) beside free ones."""
    schema, regex = StructuredOutput(json_schema=SCHEMA), StructuredOutput(regex=REGEX)
    choice = StructuredOutput(choice=["alpha", "beta gamma", "delta"])
    arrivals = [
        (0, [5, 17, 9, 30], SamplingParams(max_tokens=40, structured=schema), "g-greedy"),
        (0, [8, 8, 41, 2, 60, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured=regex), "g-seeded"),
        (0, [71, 3, 12], SamplingParams(max_tokens=24, ignore_eos=True), "free-greedy"),
        (0, [9, 44, 6, 6, 13], SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True), "free-seeded"),
        (0, [33, 20, 1, 90], SamplingParams(max_tokens=20, logprobs=2, repetition_penalty=1.3, structured=regex),
         "g-logprobs"),
        (6, [14, 15, 92, 26, 5], SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured=schema), "g-late"),
        (0, [50, 4, 19], SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured=choice), "g-choice"),
        (0, [61, 62, 63, 64], SamplingParams(temperature=1.0, seed=9, max_tokens=40, structured=schema), "g-aborted"),
    ]
    return arrivals, [(5, "g-aborted")]


def _serve(model, tok, mode: str):
    """Run the workload on a fresh engine -> (outputs, how many held rows each launch_held sampled)."""
    engine = LLMEngine(model, tok, None, num_blocks=80, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                       async_scheduling=mode != "sync", eval_thread=mode == "thread")
    held = []
    launch_held = engine.runner.launch_held

    def spy(seqs, rows, sampled, into):
        held.append(sum(not seqs[j].is_finished for j in rows.index))
        return launch_held(seqs, rows, sampled, into)

    engine.runner.launch_held = spy
    arrivals, aborts = _workload()
    out = run(engine, arrivals, aborts)
    assert_all_free(engine)
    return out, held


def test_grammar_rows_pipelined_equal_sync_and_mlx_lm(load):
    model, tok = load("llama")
    results, held = {}, {}
    # async on a worker thread (the CPU backend's default), async with mx.async_eval, synchronous
    for mode in ("thread", "async_eval", "sync"):
        results[mode], held[mode] = _serve(model, tok, mode)
    assert held["sync"] == []
    for mode in ("thread", "async_eval"):  # grammar rows really ran inside pipelined steps, several at once
        assert len(held[mode]) > 20 and max(held[mode]) >= 4, held[mode]
    sync = results["sync"]
    for mode in ("thread", "async_eval"):
        got = results[mode]
        assert got.keys() == sync.keys()
        for rid, (o, streamed) in got.items():
            want = sync[rid][0]
            assert o.token_ids == want.token_ids and o.finish_reason == want.finish_reason, (mode, rid)
            assert streamed == o.token_ids, (mode, rid)
            if rid == "g-logprobs":
                assert [e.token_id for e in o.logprobs] == o.token_ids
                for e, w in zip(o.logprobs, want.logprobs):
                    assert abs(e.logprob - w.logprob) < 1e-4 and [t for t, _ in e.top] == [t for t, _ in w.top]
    out = {rid: o for rid, (o, _) in results["thread"].items()}
    assert out["free-greedy"].token_ids == oracle(model, [71, 3, 12], 24)[0]
    for rid in ("g-seeded", "g-logprobs"):
        assert out[rid].finish_reason == "stop" and re.fullmatch(REGEX, out[rid].text), (rid, out[rid].text)
    assert out["g-choice"].finish_reason == "stop" and out["g-choice"].text in ("alpha", "beta gamma", "delta")
    for rid in ("g-greedy", "g-late"):
        if out[rid].finish_reason == "stop":
            jsonschema.validate(json.loads(out[rid].text), SCHEMA)
        else:
            assert out[rid].text.startswith("{"), out[rid].text
    assert out["g-aborted"].finish_reason == "abort"
    assert len(out["free-seeded"].token_ids) == 24


def test_a_server_prepares_the_grammar_tokenizer_before_serving(tiny_models):
    """llguidance's tokenizer holds the GIL while it is built: a server builds it as it starts, and for
    a model it loads on demand on the loading thread, not on the first request with a schema."""
    from macinfer.llm import LLM
    from macinfer.serve.model_pool import PoolOptions
    from macinfer.serve.server import create_app

    path = str(tiny_models("llama"))
    llm = LLM(path)
    assert llm.engine.grammars._tokenizer is None  # elsewhere (LLM, `macinfer run`) the first grammar builds it
    app = create_app(llm, models=PoolOptions(others={"other": path}, load=LLM))
    assert llm.engine.grammars._tokenizer is not None
    other = app.state.server.pool.options.load(path)
    assert other.engine.grammars._tokenizer is not None
