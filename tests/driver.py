"""Driving an engine through a staggered arrival plan, as the tests do."""

from __future__ import annotations


def run(engine, arrivals, after_step=None) -> dict:
    """Feed requests at their arrival steps and step the engine until everything finished.

    Args:
        engine: an LLMEngine.
        arrivals: (step, prompt ids, SamplingParams, request id) tuples.
        after_step: called with the engine after every step (invariant checks).

    Returns:
        {request id: RequestOutput}.
    """
    arrivals, outputs, step = list(arrivals), {}, 0
    while arrivals or engine.has_unfinished():
        for a in [a for a in arrivals if a[0] == step]:
            engine.add_request(a[1], a[2], request_id=a[3])
            arrivals.remove(a)
        for d in engine.step():
            if d.output is not None:
                outputs[d.request_id] = d.output
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < 1000, "engine does not make progress"
    return outputs
