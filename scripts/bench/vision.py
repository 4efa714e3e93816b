"""Benchmark images in the prompt: a second question about the same image vs the first.

A vision-language model's first request with an image runs the vision tower and prefills the
image's tokens; a second request with the same image and another question finds the image's
embeddings kept (by the image's hash) and its tokens' K/V in the prefix cache (blocks keyed by
the image's content), so it computes only the new question. Printed: the TTFT of the first
request and of the second (same image), their ratio (the target: >= 5x), the TTFT of a third
with another image (no hit: about the first's), and whether every output is identical with
the caches on and off (greedy).

The model: by default a random gemma3 built on the spot (tests/tiny_vision.py, `bench`: a
224-pixel, 4-layer tower giving 64 image tokens, a 4-layer 256-wide language model); --model
runs a real one (e.g. gemma3-4b, lfm2-vl-1.6b). TTFTs are medians of --repeats fresh engines,
each measured side by side in this run.

Usage:
    python scripts/bench/vision.py                  # ~1 min on 2 shared cores
    python scripts/bench/vision.py --model gemma3-4b --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)

from macinfer.core.sampling import SamplingParams  # noqa: E402
from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.llm import LLM  # noqa: E402
from macinfer.modelio.images import read_image  # noqa: E402

QUESTIONS = ["Describe this picture in detail.", "What colours stand out in it?"]


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def ask(engine: LLMEngine, llm: LLM, question: str, image, max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT in seconds, greedy tokens, prompt tokens found in the prefix cache) of one request."""
    ids, mm = llm.image_prompt(messages(question), [image])
    t0 = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), mm=mm)
    first, out = None, None
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id == rid and d.token_ids and first is None:
                first = time.perf_counter() - t0
            if d.request_id == rid and d.output is not None:
                out = d.output
    return first, out.token_ids, out.metrics.cached_tokens


def round_trip(llm: LLM, images: list, cache: bool, max_tokens: int) -> list[tuple[float, list[int], int]]:
    """A fresh engine (and no kept image embeddings): image A + question 1, A + question 2, B + question 1."""
    llm.images.cache.clear()
    engine = LLMEngine(llm.model, llm.tokenizer, llm.info, images=llm.images if cache else _no_keep(llm.images),
                       enable_prefix_cache=cache, max_num_seqs=1)
    return [ask(engine, llm, q, im, max_tokens) for q, im in
            ((QUESTIONS[0], images[0]), (QUESTIONS[1], images[0]), (QUESTIONS[0], images[1]))]


class _no_keep:
    """The image encoder without its kept embeddings: every request runs the tower (the cache-off baseline)."""

    def __init__(self, encoder):
        self.encoder = encoder

    def embed(self, mm, ids):
        self.encoder.cache.clear()
        return self.encoder.embed(mm, ids)

    def embed_tokens(self, ids):
        return self.encoder.embed_tokens(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a vision-language model (default: a random gemma3 built here)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    from tiny_vision import build_tiny_vlm, write_images

    tmp = Path(tempfile.mkdtemp(prefix="macinfer-vision-bench-"))
    model = args.model or str(build_tiny_vlm(tmp / "model", "gemma3", bench=True))
    images = [read_image(p) for p in write_images(tmp / "images", 2)]
    llm = LLM(model, engine="paged")
    print(f"model: {args.model or 'random gemma3 (bench shape)'}; {llm.engine.describe()}", file=sys.stderr)
    ask(LLMEngine(llm.model, llm.tokenizer, llm.info, images=llm.images, max_num_seqs=1), llm,
        QUESTIONS[0], images[1], 2)  # warm-up: MLX's first kernels, the processor's first call

    on, off = [], []
    for _ in range(args.repeats):
        on.append(round_trip(llm, images, True, args.max_tokens))
        off.append(round_trip(llm, images, False, args.max_tokens))
    ttft = [statistics.median(r[i][0] for r in on) for i in range(3)]
    identical = all(r_on[i][1] == r_off[i][1] for r_on, r_off in zip(on, off) for i in range(3))
    ids, mm = llm.image_prompt(messages(QUESTIONS[0]), images[:1])
    print(f"prompt: {len(ids)} tokens, {mm.spans[0][1] - mm.spans[0][0]} of them the image's")
    print(f"first request (image A, question 1)         TTFT {ttft[0] * 1e3:8.1f} ms  (tower + prefill)")
    print(f"second request (image A, question 2)        TTFT {ttft[1] * 1e3:8.1f} ms  "
          f"cached {on[-1][1][2]} tokens  -> {ttft[0] / ttft[1]:.1f}x sooner (target >= 5x)")
    print(f"third request (image B, question 1)         TTFT {ttft[2] * 1e3:8.1f} ms  cached {on[-1][2][2]} tokens "
          f"(another image: no hit on the image)")
    print(f"cache-off TTFTs (the same three)            "
          + "  ".join(f"{statistics.median(r[i][0] for r in off) * 1e3:.1f} ms" for i in range(3)))
    print(f"outputs identical with the caches on and off: {'yes' if identical else 'NO'}")
    if not identical or ttft[0] / ttft[1] < 5:
        sys.exit(1)


if __name__ == "__main__":
    main()
