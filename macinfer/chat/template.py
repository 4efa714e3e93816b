"""A conversation rendered through the model's chat template: messages, tools, thinking options.

What each template expects of the messages, done once here for every surface:

- an assistant turn's thought (`reasoning_content` as vLLM and DeepSeek send it back, `reasoning`
  as mlx-lm's server does, or `thinking`) goes to the template under both names the templates
  read: Qwen3's reads `reasoning_content` (and keeps it only after the last user turn), gpt-oss's
  reads `thinking`; DeepSeek-R1's drops any thought from history itself.
- tool call arguments sent as JSON text (OpenAI's shape) become objects, which templates render
  (mlx-lm's server does the same).
- `enable_thinking` (Qwen3, SmolLM3, ...: False renders the template without a thought),
  `reasoning_effort` (gpt-oss: low / medium / high) and any `chat_template_kwargs` are the
  template's variables; mlx-lm's wrapper maps enable_thinking to a template's own name for it.
- the generic tool format (macinfer.chat.tool_calls): the tools are described in a system message,
  earlier calls rendered as the JSON the model wrote, tool results as user turns.
"""

from __future__ import annotations

import json

from macinfer.chat.tool_calls import ToolSyntax, generic_system_prompt
from macinfer.errors import MacinferError

REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, *, syntax: ToolSyntax | None = None,
           enable_thinking: bool | None = None, reasoning_effort: str | None = None,
           template_kwargs: dict | None = None, tokenize: bool = True) -> list[int] | str:
    """The prompt's token ids: `messages` (OpenAI's shapes) through the chat template, with the generation prompt.

    Args:
        tools: OpenAI function tools to offer, or None.
        syntax: how the model calls tools (the generic format rewrites the conversation).
        enable_thinking, reasoning_effort, template_kwargs: template variables (None: the template's default).
        tokenize: False: the prompt's text instead (images: a vision model's processor tokenises it).

    Raises:
        MacinferError: no chat template, or the template failed on these messages (one line).
    """
    if not getattr(tokenizer, "has_chat_template", getattr(tokenizer, "chat_template", None)):
        raise MacinferError("this model has no chat template: send raw text instead")
    messages = [_with_reasoning(_with_argument_objects(m)) for m in messages]
    if tools and syntax is not None and syntax.kind == "generic":
        messages, tools = generic_messages(messages, tools), None
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=tokenize, **kwargs)
        return list(out) if tokenize else out
    except Exception as e:  # jinja's TemplateError, raise_exception() in the template, a TypeError in it ...
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MacinferError(f"the model's chat template failed on these messages ({why})") from None


def _with_reasoning(m: dict) -> dict:
    thought = next((m[k] for k in REASONING_FIELDS if isinstance(m.get(k), str) and m[k]), None)
    if m.get("role") != "assistant" or thought is None:
        return m
    return {**m, "reasoning_content": thought, "thinking": thought}


def _with_argument_objects(m: dict) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        f = dict(c.get("function") or {})
        if isinstance(f.get("arguments"), str):
            try:
                f["arguments"] = json.loads(f["arguments"]) if f["arguments"].strip() else {}
            except json.JSONDecodeError as e:
                raise MacinferError(f"a message's tool_calls arguments are not valid JSON: {e}") from None
        out.append({**c, "function": f})
    return {**m, "tool_calls": out}


def generic_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a template without tool calling (llama.cpp's generic handler's shape).

    The tool instructions join the system message (one is added if there is none); an
    assistant's calls become the JSON it wrote; a tool result becomes a user turn.
    """
    instructions = generic_system_prompt(tools)
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})}
                     for c in m["tool_calls"]]
            body = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": json.dumps(body, ensure_ascii=False)}
        elif m.get("role") == "tool":
            result = {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m.get("content", "")}}
            m = {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{instructions}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out
