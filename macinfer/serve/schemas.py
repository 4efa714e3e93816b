"""The OpenAI API's request bodies as pydantic models, the checks on them, and its error body.

What the server (macinfer.serve.server) accepts: the fields declared here. An unknown
field is refused with a 400 naming it (`check_known`), since a silently ignored field
(a misspelt `max_token`, a penalty we lacked) changes the output behind the client's
back; `macinfer serve --lenient` accepts and ignores them instead. Fields that would
change the output and that macinfer cannot honour are refused by `check_supported`.
vLLM's extensions (top_k, min_p, ignore_eos, return_token_ids, guided_json / guided_regex /
guided_choice / guided_grammar) are fields like any other, and so are the thinking controls
(`reasoning_effort`, `chat_template_kwargs`). The guided_* fields (and, on /v1/completions,
`response_format`) become the request's StructuredOutput (`structured_output`), enforced while
sampling; a chat request's `response_format`, `tools` and `tool_choice` go to macinfer.chat,
which starts the grammar after the model's thought.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from macinfer.core.grammar import StructuredOutput


DEFAULT_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 429: "rate_limit_exceeded",
                 500: "internal_error", 503: "unavailable"}


class APIError(Exception):
    """An error to send as OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        code = code or DEFAULT_CODES.get(status, "invalid_request")  # every error names its kind
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


MAX_N = 16  # choices per request at most (each is a sequence of its own)


# -- request schemas ----------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}};
    also {"type": "json_object", "schema": {...}} (llama.cpp's and Together's form, instructor's JSON_SCHEMA mode)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")


class RequestBase(BaseModel):
    """Fields both endpoints share. Unknown fields are kept in `model_extra` for `check_known`;
    fields we cannot honour are rejected by `check_supported`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None  # chat: a bool (top_logprobs says how many); completions: how many
    # mlx-lm's and vLLM's extensions: a multiplicative penalty, and how many last tokens every penalty reads.
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    user: str | None = None
    # Accepted, and they change nothing here (OpenAI's bookkeeping).
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(RequestBase):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Thinking: "none" turns it off; gpt-oss's template reads low / medium / high.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"enable_thinking": false}


class CompletionRequest(RequestBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: StrictBool = False
    max_tokens: int | None = 16  # OpenAI's default for the legacy endpoint


def check_known(req: RequestBase, lenient: bool = False) -> None:
    """Refuse a top-level field this server does not know (nested objects keep theirs).

    Args:
        req: a validated request.
        lenient: accept and ignore unknown fields instead (`macinfer serve --lenient`).

    Raises:
        APIError: 400 naming the first unknown field (alphabetically), code "unknown_parameter".
    """
    unknown = sorted(req.model_extra or {})
    if unknown and not lenient:
        raise APIError(400, f"unrecognized request argument supplied: {unknown[0]} (start the server with "
                            "--lenient to ignore unknown fields)", unknown[0], "unknown_parameter")


def check_supported(req: RequestBase) -> None:
    """Refuse the fields this server cannot honour (unsupported_parameter), and combinations that
    mean nothing (invalid_value: stream_options without stream).

    Args:
        req: a validated request.

    Raises:
        APIError: 400 naming the first such field.
    """
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    checks = [
        (not 1 <= req.n <= MAX_N, "n", f"n must be from 1 to {MAX_N}"),
        (bool(getattr(req, "echo", False)), "echo", "echo is not supported"),
    ]
    for bad, param, msg in checks:
        if bad:
            raise APIError(400, msg, param, "unsupported_parameter")


def structured_output(req: RequestBase, response_format: bool = True) -> StructuredOutput | None:
    """The shape the request's output must have: `response_format` or one guided_* field (None: free text).

    A json_schema is enforced whether or not `strict` is set (as llama.cpp does): a client that
    sends a schema wants output that follows it; so is json_object's "schema".

    Args:
        response_format: read `response_format` too (chat requests leave it to macinfer.chat,
            which starts the grammar after a thought).

    Raises:
        APIError: 400 naming the field: more than one given, or an invalid schema / regex / grammar.
    """
    rf = req.response_format if response_format and req.response_format is not None \
        and req.response_format.type != "text" else None
    given = {name: value for name, value in [
        ("response_format", rf), ("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
        ("guided_choice", req.guided_choice), ("guided_grammar", req.guided_grammar)] if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(given)}, not several", list(given)[1])
    (param, value), = given.items()
    try:
        if param == "response_format":
            if value.type == "json_object":
                so = StructuredOutput(json_object=True) if value.schema_ is None else \
                    StructuredOutput(json_schema=value.schema_ if isinstance(value.schema_, dict) else {})
            elif value.json_schema is None or value.json_schema.schema_ is None:
                raise APIError(400, "response_format.json_schema.schema is required for type json_schema",
                               "response_format.json_schema.schema")
            else:
                so = StructuredOutput(json_schema=value.json_schema.schema_)
        else:
            field = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                     "guided_grammar": "grammar"}[param]
            so = StructuredOutput(**{field: value})
        so.lark()  # checks the schema, regex or grammar now, for a 400 that names the field
        return so
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param, "invalid_value") from None


def message_text(m: ChatMessage, i: int) -> str:
    """A chat message's text: its string content, or its text parts joined.

    Args:
        m: the message.
        i: its index in `messages`, for the error.

    Returns:
        The text ("" for no content).

    Raises:
        APIError: 400 if a content part is not text.
    """
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.get('type')!r}",
                           f"messages[{i}].content")
        parts.append(part["text"])
    return "".join(parts)
