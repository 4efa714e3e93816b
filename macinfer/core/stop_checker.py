"""Appending a generated token to its sequence, and deciding whether it ends the request.

    checker = StopChecker(eos_token_ids={2})
    status = checker.append(seq, token)      # None: keep going; else FINISHED_STOPPED / FINISHED_LENGTH

A request stops at the first of: an EOS token (unless `ignore_eos`) or one of its stop token ids
(neither joins the output), a stop string in the decoded text (the text is cut before it), a
grammar that admits nothing more, or max_tokens. Both engines' schedulers call this once per
sampled token, in order, and stop at a sequence's first stop (macinfer.core.scheduler,
macinfer.engine.dense_engine); the output processor then streams what was appended.

NOTE: a stop string is searched for only in the text not yet streamed (plus the longest stop
string's length before it): the output processor holds back that many characters, so a match is
always found before any of it was streamed.
"""

from __future__ import annotations

import time

from macinfer.core.grammar import advance
from macinfer.core.sequence import Sequence, SequenceStatus


class StopChecker:
    """Appends tokens to sequences and says which token ends a request.

    Args:
        eos_token_ids: the tokenizer's end-of-sequence ids.
    """

    def __init__(self, eos_token_ids):
        self.eos_token_ids = frozenset(eos_token_ids or ())

    def append(self, seq: Sequence, tok: int) -> SequenceStatus | None:
        """Take one sampled token: its metrics, grammar and stop checks; append it unless it is a stop token.

        Returns:
            The status seq finishes with, or None while it goes on.
        """
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = time.perf_counter()
        else:
            m.decode_steps += 1
            m.kv_tokens_sum += seq.num_tokens
        p = seq.params
        logprob, seq.pending_logprob = seq.pending_logprob, None
        complete = seq.grammar is not None and advance(seq.grammar, tok)  # nothing but EOS may follow
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED  # the stop token is not part of the output
        if complete and tok in self.eos_token_ids:  # ignore_eos: the grammar still ends here
            return SequenceStatus.FINISHED_STOPPED
        seq.append_token(tok, logprob)
        if (p.stop and truncate_at_stop(seq)) or complete:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None


def truncate_at_stop(seq: Sequence) -> bool:
    """Cut seq's text before the first stop string in its new tail; whether there was one."""
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, seq.num_emitted_chars - longest)  # earlier text was checked already
    hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop if s) if i >= 0]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    seq.detokenizer = None  # freeze the text
    return True


def held_back(seq: Sequence) -> int:
    """How many trailing characters of seq's text may still turn into a stop string (not streamed yet)."""
    return max((len(s) for s in seq.params.stop), default=1) - 1
