"""The protocols on the embedded SmolLM2, where a real answer matters: an openai-agents Agent runs
its function tool to a final output over the Responses API, and one prompt at temperature 0 reads
the same through all four protocols (chat completions, Responses, Anthropic Messages, Ollama),
streamed and not.

SmolLM2's template has no tool calling: the Agent's tool runs on the generic JSON format. Given a
tool's result with tool_choice "auto", SmolLM2-135M calls the tool again rather than answering
(the agent would loop to max_turns), so the Agent stops at its first tool's output
(`tool_use_behavior="stop_on_first_tool"`); the argument it passes is read from the question.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import anthropic
import ollama
import openai
import pytest

from macinfer.llm import LLM
from macinfer.serve.server import create_app, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colours of the rainbow."}]
N = 16


@pytest.fixture(scope="module")
def url():
    with serve_in_thread(create_app(LLM(), model_name=MODEL)) as u:
        yield u


def test_openai_agents_agent_runs_its_function_tool_to_a_final_output(url):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"It is 22 C and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(name="weather", instructions="You answer questions about the weather with the get_weather tool.",
                  tools=[get_weather], model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40),
                  tool_use_behavior="stop_on_first_tool")
    config = RunConfig(tracing_disabled=True)  # nothing is sent to OpenAI's trace store

    async def both():
        plain = await Runner.run(agent, "What is the weather in Paris?", run_config=config, max_turns=2)
        streamed = Runner.run_streamed(agent, "What is the weather in Rome?", run_config=config, max_turns=2)
        kinds = [e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"]
        return plain, streamed, kinds

    plain, streamed, kinds = asyncio.run(both())
    assert asked == ["Paris", "Rome"]
    assert plain.final_output == "It is 22 C and sunny in Paris."
    assert streamed.final_output == "It is 22 C and sunny in Rome."
    assert {"response.created", "response.function_call_arguments.delta", "response.completed"} <= set(kinds)


def test_one_prompt_reads_the_same_through_all_four_protocols(url):
    system, user = MESSAGES[0]["content"], MESSAGES[1:]

    def chat(stream):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        if not stream:
            return c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)\
                .choices[0].message.content
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0, stream=True) if ch.choices)

    def responses(stream):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        kw = dict(model=MODEL, instructions=system, input=user, max_output_tokens=N, temperature=0)
        if not stream:
            return c.responses.create(**kw).output_text
        return "".join(e.delta for e in c.responses.create(stream=True, **kw) if e.type == "response.output_text.delta")

    def messages(stream):
        c = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
        kw = dict(model=MODEL, system=system, messages=user, max_tokens=N, extra_body={"temperature": 0})
        if not stream:
            return c.messages.create(**kw).content[0].text
        with c.messages.stream(**kw) as s:
            return "".join(s.text_stream)

    def ollama_chat(stream):
        c = ollama.Client(host=url, timeout=300)
        kw = dict(model=MODEL, messages=MESSAGES, options={"temperature": 0, "num_predict": N})
        if not stream:
            return c.chat(**kw).message.content
        return "".join(p.message.content for p in c.chat(stream=True, **kw))

    cases = [(f, s) for f in (chat, responses, messages, ollama_chat) for s in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:  # batched by the engine: greedy output is each one's solo output
        texts = list(pool.map(lambda case: case[0](case[1]), cases))
    assert texts[0].strip() and all(t == texts[0] for t in texts), dict(zip([f"{f.__name__}/{s}" for f, s in cases],
                                                                           texts))



def test_ollama_tools_a_call_and_its_result_streamed_and_not(url):
    """Ollama has no tool_choice: SmolLM2, shown an earlier call and its result (sent as Ollama sends
    them: arguments as an object, a `tool` message naming the tool), calls the tool for the next
    city by itself, in the generic format. The conversation renders the prompt chat completions
    renders for it."""
    c = ollama.Client(host=url, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "22 C and sunny", "tool_name": "get_weather"},
               {"role": "assistant", "content": "It is 22 C and sunny in Paris."},
               {"role": "user", "content": "And in Rome?"}]
    options = {"temperature": 0, "num_predict": 40}
    r = c.chat(model=MODEL, messages=history, tools=tools, options=options)
    (call,) = r.message.tool_calls
    assert (call.function.name, call.function.arguments, r.done_reason) == ("get_weather", {"city": "Rome"}, "stop")
    parts = list(c.chat(model=MODEL, messages=history, tools=tools, options=options, stream=True))
    assert [tc.function.arguments for p in parts for tc in p.message.tool_calls or []] == [{"city": "Rome"}]

    as_chat = [dict(m) for m in history]
    as_chat[1] = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1_0", "type": "function",  # the id Ollama's call gets here: call_<message>_<call>
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    as_chat[2] = {"role": "tool", "tool_call_id": "call_1_0", "content": "22 C and sunny"}
    want = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300).chat.completions.create(
        model=MODEL, messages=as_chat, tools=tools, max_tokens=1, temperature=0)
    assert r.prompt_eval_count == want.usage.prompt_tokens
