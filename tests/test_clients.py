"""The client libraries people build on, against `macinfer serve` on the embedded SmolLM2: each
returns a valid object for every seed at temperature 0.7.

The suite runs 2 seeds per case (the embedded model decodes a few tokens a second here);
`scripts/check_clients.py` runs these same cases over 10 seeds and prints k of 10 per client.

SmolLM2's chat template has no tool calling, so every tool case runs on the generic JSON format
(macinfer.chat.tool_calls): the tools described in a system message, the call held to the
schema by the grammar. The cases of one client run their 10 seeds concurrently, so the engine
batches them (the prompt's prefix is computed once).
"""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pydantic import BaseModel, Field

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

pytestmark = pytest.mark.slow

SEEDS = range(2)
PROMPT = "What is the weather in Paris? Answer with the city and the temperature."
MESSAGES = [{"role": "user", "content": PROMPT}]
NAMED = {"type": "function", "function": {"name": "Weather"}}


class Weather(BaseModel):
    city: str = Field(max_length=12)  # bounded: a sampled string cannot run to max_tokens
    celsius: int = Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def url():
    with serve_in_thread(create_app(LLM(), model_name="smollm2")) as u:
        yield u


def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def each_seed(case, url, seeds=SEEDS) -> list:
    """case(url, seed) for every seed, concurrently; the results (or the exceptions) in seed order."""
    def one(seed):
        try:
            return case(url, seed)
        except Exception as e:  # noqa: BLE001 - reported per seed below
            return e

    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(one, seeds))


# -- the cases: each returns a Weather (or raises) ----------------------------------------------
def openai_parse(url, seed):
    r = client(url).chat.completions.parse(model="smollm2", messages=MESSAGES, response_format=Weather,
                                           temperature=0.7, seed=seed)
    return r.choices[0].message.parsed


def forced_call(choice, stream: bool):
    def case(url, seed):
        kw = dict(model="smollm2", messages=MESSAGES, tools=[openai.pydantic_function_tool(Weather)],
                  tool_choice=choice, temperature=0.7, seed=seed)
        if not stream:
            (call,) = client(url).chat.completions.create(**kw).choices[0].message.tool_calls
            assert call.function.name == "Weather"
            return Weather.model_validate_json(call.function.arguments)
        names, args, finish = [], "", None
        for chunk in client(url).chat.completions.create(stream=True, **kw):
            for tc in chunk.choices[0].delta.tool_calls or []:
                assert tc.index == 0
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert names == ["Weather"] and finish == "tool_calls"
        return Weather.model_validate_json(args)
    return case


def instructor_mode(mode_name: str):
    def case(url, seed):
        import instructor

        c = instructor.from_openai(client(url), mode=getattr(instructor.Mode, mode_name))
        return c.chat.completions.create(model="smollm2", response_model=Weather, messages=MESSAGES,
                                         temperature=0.7, seed=seed, max_retries=0)
    return case


def langchain(method: str):
    def case(url, seed):
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model="smollm2", temperature=0.7, seed=seed,
                         max_retries=0)
        return llm.with_structured_output(Weather, method=method).invoke(PROMPT)
    return case


def pydantic_ai_agent(url, seed):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=Weather, retries=0, model_settings=ModelSettings(temperature=0.7, seed=seed))
    return agent.run_sync(PROMPT).output


CASES = {
    "openai-parse": openai_parse,
    "openai-required": forced_call("required", stream=False),
    "openai-required-streamed": forced_call("required", stream=True),
    "openai-named": forced_call(NAMED, stream=False),
    "openai-named-streamed": forced_call(NAMED, stream=True),
    "instructor-tools": instructor_mode("TOOLS"),
    "instructor-json-schema": instructor_mode("JSON_SCHEMA"),
    "langchain-json-schema": langchain("json_schema"),
    "langchain-function-calling": langchain("function_calling"),
    "pydantic-ai-output-type": pydantic_ai_agent,
}


@pytest.mark.parametrize("name", list(CASES))
def test_client_returns_a_valid_object_for_every_seed(url, name):
    results = each_seed(CASES[name], url)
    bad = {seed: repr(r)[:300] for seed, r in zip(SEEDS, results) if not isinstance(r, Weather)}
    assert not bad, f"{name}: {len(SEEDS) - len(bad)} of {len(SEEDS)} valid; failures: {bad}"
