"""The grammars a chat request's reply is held to (llguidance's Lark dialect), in the model's own syntax.

    tool_choice "required"     at least one call (one with parallel_tool_calls false), of any tool
    tool_choice named          one call of that function
    the generic format         a template without tool calling: `{"tool_call": ...}` or `{"response": ...}`
    response_format            json_object (with or without "schema"), json_schema (strict or not)

Each call's arguments are held to its tool's JSON schema (`%json` in the grammar). For a model that
thinks, the grammar starts with its thought: `<think> ... </think>` (optional when the model opens
it itself, just `... </think>` when the prompt opened it), harmony's analysis message; markers that
are single tokens are named by id (`<[id]>`), so no text can fake them.

A native syntax is constrained only where the layout is known here (JSON in `<tool_call>` tags,
Mistral's `[TOOL_CALLS]`, Qwen3-Coder's XML parameters); `Unconstrainable` names any other.
"""

from __future__ import annotations

import json

from macinfer.chat.reasoning import Thinking
from macinfer.chat.tool_calls import ToolSyntax
from macinfer.core.grammar import JSON_WHITESPACE, StructuredOutput

# Whitespace between a thought's end and what follows (Qwen3 writes "\n\n").
GAP = r"/[ \t\n]{0,4}/"
THOUGHT = r"/(.|\n)*/"


class Unconstrainable(ValueError):
    """A tool-call syntax this module cannot write a grammar for (the message names it)."""


def marker(tokenizer, text: str) -> str:
    """A marker in Lark: `<[id]>` when it is one token of the vocabulary, else its literal text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def json_rule(schema) -> str:
    """`%json {...}` for a JSON schema, with llama.cpp's bounded whitespace (macinfer.core.grammar)."""
    schema = {} if schema is True else dict(schema)
    schema.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
    return "%json " + json.dumps(schema)


def thought_prefix(tokenizer, thinking: Thinking | None, open_in_prompt: bool, enabled: bool) -> str:
    """The grammar's start before the reply proper ("" for a model that does not think here)."""
    if thinking is None:
        return ""
    if thinking.family == "harmony":
        start, ch, msg, end = (marker(tokenizer, t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>"))
        return f'({ch} "analysis" {msg} {THOUGHT} {end} {start} "assistant")? '
    end = marker(tokenizer, thinking.end) if thinking.end_id is not None else None
    if end is None:  # a multi-token end marker: the thought is the shortest text ending with it
        body = f"/(?s:.*?){_regex_escape(thinking.end)}/"
    else:
        body = f"{THOUGHT} {end}"
    if open_in_prompt:
        return f"{body} {GAP} "
    if not enabled:
        return ""
    start = marker(tokenizer, thinking.start)
    return f"({start} {body} {GAP})? "


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|" else c for c in text)


def tool_grammar(tokenizer, syntax: ToolSyntax, tools: list[dict], prefix: str, required: bool,
                 parallel: bool, response_schema=None) -> str:
    """The Lark grammar of a reply that calls tools (`tools`: those it may call).

    Args:
        prefix: the thought before it (thought_prefix).
        required: a call must be made; otherwise (the generic format's "auto") a response may
            come instead, a string or held to `response_schema`.
        parallel: several calls may be made (else exactly one).
    """
    calls = {"generic": _generic_calls, "harmony": _harmony_call, "native": _native_calls}[syntax.kind]
    body = calls(tokenizer, syntax, tools, parallel)
    if not required:
        if syntax.kind == "generic":
            response = json_rule(response_schema) if response_schema is not None else "JSON_STRING"
            body = f'{body} | "{{\\"response\\": " {response} "}}"'
        elif response_schema is not None:
            body = f"{body} | {json_rule(response_schema)}"
    return f"start: {prefix}({body})\n" + JSON_STRING


def answer_grammar(tokenizer, thinking: Thinking | None, prefix: str, schema) -> str:
    """The Lark grammar of a reply whose answer is JSON under `schema` (after the thought)."""
    if thinking is not None and thinking.family == "harmony":
        ch, msg = marker(tokenizer, "<|channel|>"), marker(tokenizer, "<|message|>")
        return f'start: {prefix}{ch} "final" {msg} {json_rule(schema)}\n'
    return f"start: {prefix}{json_rule(schema)}\n"


JSON_STRING = r'JSON_STRING: /"(\\([\"\\\/bfnrt]|u[a-fA-F0-9]{4})|[^\"\\\x00-\x1F\x7F])*"/' + "\n"


def _call_object(tool: dict) -> str:
    """`{"name": "NAME", "arguments": <schema>}`, the layout tool_calls.JSON_TOOLS_HEAD streams."""
    f = tool["function"]
    head = json.dumps(f'{{"name": {json.dumps(f["name"])}, "arguments": ')
    return f"{head} {json_rule(f.get('parameters') or {'type': 'object'})} \"}}\""


def _generic_calls(tokenizer, syntax, tools, parallel) -> str:
    one = " | ".join(f"({_call_object(t)})" for t in tools)
    if parallel:
        return f'"{{\\"tool_calls\\": [" ({one}) (", " ({one}))* "]}}"'
    return f'"{{\\"tool_call\\": " ({one}) "}}"'


def _harmony_call(tokenizer, syntax, tools, parallel) -> str:
    # One call per turn: its <|call|> ends the reply (gpt-oss's stop tokens).
    ch, con, msg = (marker(tokenizer, t) for t in ("<|channel|>", "<|constrain|>", "<|message|>"))
    alts = [f'{ch} {json.dumps("commentary to=functions." + t["function"]["name"] + " ")} {con} "json" {msg} '
            f'{json_rule(t["function"].get("parameters") or {"type": "object"})}' for t in tools]
    return " | ".join(f"({a})" for a in alts)


def _native_calls(tokenizer, syntax, tools, parallel) -> str:
    if syntax.parser == "json_tools":
        start, end = marker(tokenizer, syntax.start), marker(tokenizer, syntax.end)
        one = f'{start} "\\n" ({" | ".join(f"({_call_object(t)})" for t in tools)}) "\\n" {end}'
        return f'({one}) ("\\n" ({one}))*' if parallel else one
    if syntax.parser == "mistral":
        start = marker(tokenizer, syntax.start)
        alts = " | ".join(f'({json.dumps(t["function"]["name"] + "[ARGS]")} '
                          f'{json_rule(t["function"].get("parameters") or {"type": "object"})})' for t in tools)
        return f"{start} ({alts})+" if parallel else f"{start} ({alts})"
    if syntax.parser == "qwen3_coder":
        start, end = marker(tokenizer, syntax.start), marker(tokenizer, syntax.end)
        one = f'{start} ({" | ".join(f"({_xml_function(t)})" for t in tools)}) {end}'
        return f'({one}) ("\\n" ({one}))*' if parallel else one
    raise Unconstrainable(f"the {syntax.parser} tool-call syntax cannot be constrained here (JSON in <tool_call> "
                          "tags, Mistral's [TOOL_CALLS], Qwen3-Coder's XML and models without tool calling can): "
                          "use tool_choice 'auto'")


def _xml_function(tool: dict) -> str:
    """Qwen3-Coder's `<function=NAME>` block: each parameter in `<parameter=KEY>` lines, in the schema's
    order (the required ones always), a string as raw text (no '<' or line break), any other
    value as JSON under its schema (mlx-lm's qwen3_coder parser reads them back by type)."""
    f = tool["function"]
    params = f.get("parameters") or {}
    required = set(params.get("required", []))
    parts = []
    for key, schema in (params.get("properties") or {}).items():
        piece = f"{json.dumps(f'<parameter={key}>' + NL)} {_xml_value(schema)} {json.dumps(NL + '</parameter>' + NL)}"
        parts.append(f"({piece})" if key in required else f"({piece})?")
    head = json.dumps(f"{NL}<function={f['name']}>{NL}")
    return f"{head} {' '.join(parts)} {json.dumps('</function>' + NL)}"


NL = "\n"


def _xml_value(schema: dict) -> str:
    if isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema:
        limit = schema.get("maxLength")
        return f"/[^<\\n]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<\\n]*/"
    if isinstance(schema, dict) and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")"
    return json_rule(schema)


def structured(grammar: str) -> StructuredOutput:
    """The grammar as the engine takes it, checked (ValueError: one line on what is wrong)."""
    so = StructuredOutput(grammar=grammar)
    so.lark()
    return so
