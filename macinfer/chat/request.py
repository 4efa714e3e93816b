"""A chat request made ready for the engine: prompt ids, sampling with its grammar, a parser per reply.

    req = ChatRequest(messages, tools=..., tool_choice="required", response_format=...)
    prepared = prepare(tokenizer, req, SamplingParams(temperature=0.7, max_tokens=256))
    engine.add_request(prepared.prompt_ids, prepared.params)
    parser = prepared.new_parser()            # one per reply (n > 1: one each)

Every protocol (OpenAI chat completions here; Responses, Anthropic, Ollama as thin adapters) goes
through `prepare` and renders the parser's events (macinfer.chat.events). Bad input raises
ChatRequestError naming the request field, for a 400.

The decisions, in order:
1. tools: none (or tool_choice "none"): nothing is offered or parsed. Otherwise the model's syntax
   (macinfer.chat.tool_calls): its own, harmony's, or the generic JSON format.
2. the prompt: the template with tools, thinking options and the conversation (macinfer.chat.template).
3. the grammar (macinfer.chat.constraints): tool_choice "required" or named, the generic format,
   or response_format json_object / json_schema; after the thought for a model that thinks. A
   model that does not think keeps plain JSON-schema constraints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from macinfer.chat import constraints
from macinfer.chat.output import OutputParser
from macinfer.chat.reasoning import harmony_encoding, thinking_of, thought_open
from macinfer.chat.template import render
from macinfer.chat.tool_calls import tool_syntax
from macinfer.core.grammar import StructuredOutput
from macinfer.core.sampling_params import SamplingParams
from macinfer.errors import MacinferError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ChatRequestError(MacinferError):
    """A request field that cannot be honoured: `param` names it (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


@dataclass
class ChatRequest:
    """What a chat reply is asked to be.

    Args:
        messages: OpenAI's chat messages (dicts; text content).
        tools: OpenAI function tools ({"type": "function", "function": {name, description, parameters}}).
        tool_choice: "auto" (None), "none", "required", or {"type": "function", "function": {"name": ...}}.
        parallel_tool_calls: False allows one call (None / True: several).
        response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...},
            "schema": ...} (json_object with "schema" is llama.cpp's and Together's form).
        enable_thinking: think before answering (None: the template's default).
        reasoning_effort: gpt-oss's "low" / "medium" / "high"; "none" turns thinking off.
        template_kwargs: further chat template variables (`chat_template_kwargs`).
    """

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    template_kwargs: dict | None = None


@dataclass
class PreparedChat:
    prompt_ids: list[int]
    params: SamplingParams
    new_parser: Callable[[], OutputParser]
    tools: list[dict] | None  # the tools offered (None: none)
    mm: Any = None  # the prompt's images (macinfer.modelio.multimodal.MultiModalInputs), or None


def prepare(tokenizer, req: ChatRequest, params: SamplingParams | None = None, images: list | None = None,
            vision=None) -> PreparedChat:
    """Prompt ids, sampling parameters (with the reply's grammar) and a parser factory for `req`.

    Args:
        tokenizer: the model's tokenizer (mlx-lm's TokenizerWrapper).
        params: sampling; its `structured` (a guided_* grammar) must not meet a grammar the request implies.
        images: RGB images, one per {"type": "image"} part of the messages, in order; `vision` (the
            model's macinfer.modelio.vision.ImageEncoder) tokenises the rendered text with them.

    Raises:
        ChatRequestError: a field that cannot be honoured, named.
        MacinferError: the model's format cannot be read here (harmony's vocabulary missing).
    """
    params = params or SamplingParams()
    if not req.messages:
        raise ChatRequestError("messages must hold at least one message", "messages")
    thinking = thinking_of(tokenizer)
    if thinking is not None and thinking.family == "harmony":
        harmony_encoding()  # its MacinferError now, not from the first parser
    tools, named = _offered_tools(req)
    syntax = tool_syntax(tokenizer, thinking) if tools else None
    enable = req.enable_thinking
    if enable is None and isinstance((req.template_kwargs or {}).get("enable_thinking"), bool):
        enable = req.template_kwargs["enable_thinking"]
    if req.reasoning_effort == "none":
        enable = False
    effort = req.reasoning_effort if req.reasoning_effort not in (None, "none") else None
    mm = None
    try:
        ids = render(tokenizer, req.messages, tools, syntax=syntax, enable_thinking=enable, reasoning_effort=effort,
                     template_kwargs={k: v for k, v in (req.template_kwargs or {}).items() if k != "enable_thinking"},
                     tokenize=not images)
        if images:  # the processor expands each image's placeholder into its tokens
            ids, mm = vision.process(ids, images)
    except MacinferError as e:
        raise ChatRequestError(str(e), "messages") from None
    opened = thought_open(tokenizer, thinking, ids)
    grammar = _grammar(tokenizer, req, thinking, opened, enable is not False, syntax, tools, named)
    if grammar is not None:
        if params.structured is not None:
            raise ChatRequestError(f"give one of {_grammar_field(req)} and the guided_* fields, not both",
                                   _grammar_field(req))
        params = dataclasses.replace(params, structured=grammar)
    return PreparedChat(ids, params, partial(OutputParser, tokenizer, thinking, opened, syntax, tools, len(ids)),
                        tools, mm)


def _offered_tools(req: ChatRequest) -> tuple[list[dict] | None, str | None]:
    """(the tools to offer, the function tool_choice names): checks tools and tool_choice."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "auto", "none"):
            raise ChatRequestError("tool_choice needs tools: send the tools it may choose from", "tool_choice")
        return None, None
    for i, t in enumerate(req.tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str):
            raise ChatRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                   f"tools[{i}]")
    if choice == "none":
        return None, None
    if choice in (None, "auto", "required"):
        return req.tools, None
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
        if name not in [t["function"]["name"] for t in req.tools]:
            raise ChatRequestError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return req.tools, name
    raise ChatRequestError("tool_choice must be 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def _grammar_field(req: ChatRequest) -> str:
    return "tool_choice" if req.tool_choice not in (None, "auto", "none") else "response_format"


def _response_schema(req: ChatRequest):
    """The JSON schema the answer must follow (True: any JSON object), or None for free text."""
    rf = req.response_format
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ChatRequestError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                               "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")
        return {"type": "object"} if schema is None else schema
    schema = (rf.get("json_schema") or {}).get("schema")
    if schema is None:
        raise ChatRequestError("response_format.json_schema.schema is required for type json_schema",
                               "response_format.json_schema.schema")
    return schema


def _grammar(tokenizer, req, thinking, opened, enabled, syntax, tools, named) -> StructuredOutput | None:
    schema = _response_schema(req)
    if schema is not None:
        _check_schema(schema, "response_format")
    prefix = constraints.thought_prefix(tokenizer, thinking, opened, enabled)
    forced = named is not None or req.tool_choice == "required"
    if tools is not None and (forced or syntax.kind == "generic" or (schema is not None and syntax.kind != "harmony")):
        offered = [t for t in tools if t["function"]["name"] == named] if named else tools
        for i, t in enumerate(tools):
            if t in offered:
                _check_schema(t["function"].get("parameters") or {"type": "object"}, f"tools[{i}].function.parameters")
        # NOTE: several calls only where asked for: by default a native syntax may repeat its call (as
        # OpenAI's default parallel_tool_calls), the generic format makes one (as llama.cpp's).
        parallel = named is None and (req.parallel_tool_calls is True if syntax.kind == "generic"
                                      else req.parallel_tool_calls is not False)
        try:
            text = constraints.tool_grammar(tokenizer, syntax, offered, prefix, required=forced, parallel=parallel,
                                            response_schema=schema)
        except constraints.Unconstrainable as e:
            raise ChatRequestError(str(e), "tool_choice" if forced else "response_format") from None
        return _checked(text, "tool_choice" if forced else "tools")
    if schema is None:
        return None
    if not prefix and (thinking is None or thinking.family != "harmony"):  # plain JSON, as without a chat layer
        return StructuredOutput(json_schema=schema if isinstance(schema, dict) else {})
    return _checked(constraints.answer_grammar(tokenizer, thinking, prefix, schema), "response_format")


def _check_schema(schema, param: str) -> None:
    """A 400 naming `param` for a schema llguidance cannot compile."""
    if not isinstance(schema, (dict, bool)):
        raise ChatRequestError(f"{param} must be a JSON schema (an object)", param)
    try:
        StructuredOutput(json_schema=schema if isinstance(schema, dict) else {}).lark()
    except ValueError as e:
        raise ChatRequestError(f"{param}: {e}", param) from None


def _checked(grammar: str, param: str) -> StructuredOutput:
    try:
        return constraints.structured(grammar)
    except ValueError as e:
        raise ChatRequestError(f"{param}: the grammar cannot be used: {e}", param) from None
