"""The n-gram index of one growing token list: prompt lookup in O(new tokens) per step.

Prompt lookup asks, every decode step, where the last n tokens (n = max_n down to min_n) last
occurred earlier in the sequence. Scanning the whole list for it is cheap alone (~35 us for
a chat turn with numpy) but runs on the engine thread while the step before computes, and on
a 2-core host that thread shares the cores with the model's BLAS threads: the same scan
measured 1.5 ms of the engine thread's CPU per step there (4% of a SmolLM2 step), and what the
engine thread spends there the step waits for. The index keeps, per n, each n-gram's latest
start; a step adds the windows its new tokens completed and looks up one key per n.

Invariant: after `update(tokens)`, `latest[n - min_n][tuple(tokens[s:s + n])]` is the largest
s with s + n < len(tokens) (a window with a token after it) for every n-gram that occurs so.
"""

from __future__ import annotations


class NgramIndex:
    """Each n-gram's latest start in a token list that only grows (a changed list is indexed anew).

    Args:
        min_n, max_n: the n-gram sizes kept.
        max_match: how far back `match` measures the match length.

    Example:
        >>> NgramIndex(2, 4).match([7, 1, 2, 3, 4, 9, 7, 1, 2, 3], 8)  # "7 1 2 3" matched: m = 4
        ([4, 9, 7, 1, 2, 3], 4)
    """

    def __init__(self, min_n: int, max_n: int, max_match: int = 32):
        self.min_n, self.max_n, self.max_match = min_n, max_n, max_match
        self.latest: list[dict[tuple, int]] = [{} for _ in range(min_n, max_n + 1)]
        self.size = 0  # tokens indexed
        self.last = None  # tokens[size - 1] when indexed: a list changed in place is noticed here

    def update(self, tokens: list[int]) -> None:
        """Index the windows completed by tokens[size:] (the whole list if it shrank or changed)."""
        L = len(tokens)
        if L < self.size or (self.size and tokens[self.size - 1] != self.last):
            self.__init__(self.min_n, self.max_n, self.max_match)
        for n, table in zip(range(self.min_n, self.max_n + 1), self.latest):
            for s in range(max(0, self.size - n), L - n):  # windows with a token after them, new ones only
                table[tuple(tokens[s: s + n])] = s
        self.size = L
        self.last = tokens[L - 1] if L else None

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the last n tokens, longest n
        first; the match length m: how many tokens before the end agree with those before it)."""
        self.update(tokens)
        L = len(tokens)
        if k <= 0 or L <= self.min_n:
            return [], 0
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            hit = self.latest[n - self.min_n].get(tuple(tokens[L - n:]))
            if hit is not None:
                m = n  # extend the match backwards: tokens before the hit vs before the suffix
                while m < self.max_match and hit - (m - n) > 0 and tokens[hit - (m - n) - 1] == tokens[L - m - 1]:
                    m += 1
                return tokens[hit + n: hit + n + k], m
        return [], 0
