"""How a model talks: its chat template, its thoughts, its tool calls, and the grammars that hold them.

One model of a chat reply shared by every surface (`serve`, `run`, `chat`), as a layer over the
engine's stream of StreamDeltas (text + token ids):

    request.py      ChatRequest -> prepare(): prompt ids, SamplingParams (with a grammar), a parser per reply
    template.py     messages, tools and thinking options through the tokenizer's chat template
    reasoning.py    which family a model thinks in (`<think>` tags, gpt-oss's harmony channels)
    tool_calls.py   which syntax it calls tools in (mlx-lm's parsers, harmony, the generic JSON format)
    constraints.py  the llguidance grammars: forced tool calls, response formats, after the thought
    output.py       OutputParser: a reply's deltas -> events (thinking, content, tool calls, finish)
    events.py       those events, for any protocol to render
"""
