"""Vision-language models on the paged engine against mlx-vlm's own generation.

The oracle for every greedy request is mlx-vlm's `generate_step` on that request alone: its own
processor (`prepare_inputs`) makes the ids and pixels from the same text and images, its own model
(language model included) runs them on contiguous caches. The engine runs the language model
mlx-lm loads (paged, batched, chunked, preempted, hitting the prefix cache) with mlx-vlm's vision
tower in front. Three families (tests/tiny_vision.py): gemma3 (sliding-window layers, scaled
embeddings), mistral3 (pixtral's tower, [IMG_BREAK] rows) and lfm2-vl (a hybrid: conv state slots).
"""

from __future__ import annotations

import pytest

import macinfer  # noqa: F401  (OpenBLAS before mlx)

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402

from macinfer.core.sampling import SamplingParams  # noqa: E402
from macinfer.core.state_pool import StateScheduler  # noqa: E402
from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.errors import MacinferError  # noqa: E402
from macinfer.llm import LLM  # noqa: E402
from macinfer.modelio.images import read_image  # noqa: E402
from tiny_vision import FAMILIES, build_tiny_vlm, write_images  # noqa: E402

MAX_TOKENS = 10
QUESTIONS = ["Describe the fox", "What is the capital of France?"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return [read_image(p) for p in write_images(tmp_path_factory.mktemp("images"), 3)]


_built: dict = {}


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    """(family, LLM, mlx-vlm model, mlx-vlm processor) for one tiny family, built once."""
    from mlx_vlm.utils import load

    family = request.param
    if family not in _built:
        path = build_tiny_vlm(tmp_path_factory.mktemp(f"vlm-{family}"), family)
        llm = LLM(str(path), engine="paged", num_blocks=64, block_size=4)
        _built[family] = (family, llm, *load(str(path)))
    return _built[family]


def messages(question: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}]


def oracle(vlm_model, processor, llm, question: str, pics: list) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) from mlx-vlm alone."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import prepare_inputs

    text = llm.tokenizer.apply_chat_template(messages(question, len(pics)), tokenize=False, add_generation_prompt=True)
    if pics:
        inputs = prepare_inputs(processor, images=pics, prompts=text, image_token_index=vlm_model.config.image_token_index)
        ids, pixels, mask = inputs.pop("input_ids"), inputs.pop("pixel_values"), inputs.pop("attention_mask")
    else:
        ids = mx.array([llm.tokenizer.encode(text, add_special_tokens=False)])
        pixels, mask, inputs = None, mx.ones(ids.shape, dtype=mx.int32), {}
    steps = generate_step(ids, vlm_model, pixels, mask, max_tokens=MAX_TOKENS, temperature=0.0, **inputs)
    return ids[0].tolist(), [int(t) for (t, _), _ in zip(steps, range(MAX_TOKENS))]


def prompt(llm, question: str, pics: list):
    """(ids, mm) as the engine gets them (mm None for text only)."""
    if not pics:
        text = llm.tokenizer.apply_chat_template(messages(question, 0), tokenize=False, add_generation_prompt=True)
        return llm.tokenizer.encode(text, add_special_tokens=False), None
    return llm.image_prompt(messages(question, len(pics)), pics)


def run(engine, arrivals):
    """Step to the end; arrivals: (step, rid, ids, mm). Returns {rid: token ids}."""
    arrivals, out, step = list(arrivals), {}, 0
    while arrivals or engine.has_unfinished():
        for a in [a for a in arrivals if a[0] == step]:
            engine.add_request(a[2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), request_id=a[1], mm=a[3])
            arrivals.remove(a)
        for d in engine.step():
            if d.output is not None:
                out[d.request_id] = d.output.token_ids
        step += 1
        assert step < 500
    return out


def engine_for(llm, **options) -> LLMEngine:
    """Another paged engine on the same loaded model and image encoder."""
    return LLMEngine(llm.model, llm.tokenizer, llm.info, images=llm.images, **options)


def test_staggered_batch_with_preemption_matches_mlx_vlm(vlm, images):
    """0, 1 and 2 images, with text-only requests, arriving apart, in 4-token blocks and 8-token chunks
    (image tokens cut across chunks), in a pool too small for all of them: each request's greedy
    tokens are mlx-vlm's for it alone."""
    family, llm, vmodel, processor = vlm
    cases = {"t0": (QUESTIONS[0], []), "i1": (QUESTIONS[0], images[:1]), "i2": (QUESTIONS[1], images[:2]),
             "t1": (QUESTIONS[1], []), "i1b": (QUESTIONS[1], images[2:3])}
    want, arrivals = {}, []
    for step, (rid, (q, pics)) in zip((0, 0, 1, 2, 3), cases.items()):
        ids, mm = prompt(llm, q, pics)
        oracle_ids, want[rid] = oracle(vmodel, processor, llm, q, pics)
        assert ids == oracle_ids, rid  # the same processor, the same prompt
        assert mm is None or mm.num_images == len(pics)
        arrivals.append((step, rid, ids, mm))
    demand = sum(len(a[2]) + MAX_TOKENS for a in arrivals)
    engine = engine_for(llm, num_blocks=demand // 4 // 2 + 2, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                        enable_prefix_cache=False)
    got = run(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0, "the pool never ran out: the test proves nothing"
    assert got == want
    assert all(a[3].embeds is None for a in arrivals if a[3] is not None)  # dropped once prefilled
    assert len({tuple(want["i1"]), tuple(want["t0"])}) == 2, "the image never mattered: the test proves nothing"


def test_same_image_hits_the_prefix_cache_and_another_image_does_not(vlm, images, monkeypatch):
    """A second question about the same image reuses the image's blocks (the vision tower does not run);
    a different image in the same place is no hit there, and its answer is mlx-vlm's, not the first's.
    With n-gram speculation on: still mlx-vlm's tokens."""
    family, llm, vmodel, processor = vlm
    engine = engine_for(llm, num_blocks=64, block_size=4, max_num_batched_tokens=64, draft="ngram",
                        state_snapshot_memory=f"{16 * 64 << 10}B")  # drafts verified exactly, images or not
    if isinstance(engine.scheduler, StateScheduler):  # a hybrid: a snapshot where the images end (short prompts)
        monkeypatch.setattr(engine.scheduler, "min_snapshot_tokens", 4)
    llm.images.cache.clear()
    runs = llm.images.tower_runs

    def ask(rid, question, pic):
        ids, mm = prompt(llm, question, [pic])
        before = engine.kv_stats()["prefix_hit_tokens"]
        got = run(engine, [(0, rid, ids, mm)])[rid]
        assert got == oracle(vmodel, processor, llm, question, [pic])[1], rid
        return got, engine.kv_stats()["prefix_hit_tokens"] - before, mm

    first, hit, mm = ask("a", QUESTIONS[0], images[0])
    assert hit == 0 and llm.images.tower_runs == runs + 1
    _, hit, _ = ask("b", QUESTIONS[1], images[0])  # same image, another question
    assert hit >= mm.end // 4 * 4, "the image's blocks were not reused"
    assert llm.images.tower_runs == runs + 1, "the vision tower ran again for the same image"
    other, hit, mm2 = ask("c", QUESTIONS[0], images[1])  # another image, the first question
    assert hit <= mm2.spans[0][0] and llm.images.tower_runs == runs + 2, "a different image hit the first one's"
    assert other != first


def test_bad_input_is_one_line(vlm, images, tmp_path):
    family, llm, *_ = vlm
    with pytest.raises(MacinferError, match="at most"):
        llm.image_prompt(messages("hi", 9), images[:1] * 9)
    with pytest.raises(MacinferError, match="placeholders"):
        llm.images.process("no placeholder here", images[:1])
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(MacinferError, match="not an image"):
        read_image(bad)
    ids, mm = prompt(llm, "hi", images[:1])
    text = LLMEngine(llm.model, llm.tokenizer, llm.info, num_blocks=16, block_size=4)
    with pytest.raises(MacinferError, match="does not take images"):
        text.add_request(ids, SamplingParams(max_tokens=2), mm=mm)
    assert run(text, [(0, "ok", ids[:5], None)])["ok"]  # the engine keeps serving
