"""The speculator an engine gets from its `draft=` option: a drafter inside a SpecDecoder.

    "ngram"               prompt lookup (NgramDrafter)
    "<model>"             a draft model: shipped name, path, catalog name or repo id; a
                          feature draft reads the target's hidden states (FeatureDrafter)
    "<model>+ngram"       lookup where the text repeats itself, the model elsewhere
    "auto"                the draft shipped for the target, with lookup; none if there is none
"""

from __future__ import annotations

from macinfer.errors import MacinferError
from macinfer.spec_decode.decoder import SpecDecoder, verify_rows
from macinfer.spec_decode.draft_model import SHIPPED_DRAFTS, load_draft
from macinfer.spec_decode.drafter import DraftModelDrafter, Drafter, LookupDrafter, NgramDrafter
from macinfer.spec_decode.feature_draft import FeatureDraft, FeatureDrafter


def shipped_draft_for(model_name: str | None) -> str | None:
    """The name of the draft shipped for this model, if any (macinfer.spec_decode.draft_model.SHIPPED_DRAFTS)."""
    path = SHIPPED_DRAFTS.get(model_name or "")
    return model_name if path is not None and path.is_dir() else None


def make_drafter(draft, model, tokenizer, num_blocks: int, block_size: int, runner=None) -> Drafter:
    """"ngram", a draft model spec (shipped name, path, catalog name, repo id), a loaded model or a Drafter.

    "<model spec>+ngram" drafts by n-gram lookup where the sequence copies itself and with the
    model elsewhere (drafter.LookupDrafter). A feature draft (macinfer.spec_decode.feature_draft) also needs
    the target's ModelRunner (`runner`), whose forwards hand it their hidden states.
    """
    if isinstance(draft, str) and draft.lower() == "ngram":
        return NgramDrafter()
    if isinstance(draft, str) and draft.lower().endswith("+ngram") and draft[: -len("+ngram")]:
        return LookupDrafter(make_drafter(draft[: -len("+ngram")], model, tokenizer, num_blocks, block_size, runner))
    if hasattr(draft, "propose") and hasattr(draft, "available"):
        return draft  # a Drafter already
    name = "draft"
    if isinstance(draft, str) or hasattr(draft, "__fspath__"):
        name = str(draft)
        draft = load_draft(draft, model, tokenizer)
    if isinstance(draft, FeatureDraft):
        if runner is None:
            raise MacinferError("a feature draft needs the target's model runner")
        return FeatureDrafter(draft, runner, num_blocks, block_size, name=name)
    return DraftModelDrafter(draft, num_blocks, block_size, name=name)  # an mlx-lm model


def make_spec_decoder(config, model, tokenizer, model_name: str | None, num_blocks: int, block_size: int,
                      block_pool, runner=None) -> SpecDecoder | None:
    """The engine's SpecDecoder for EngineConfig `config`, or None without a draft.

    draft="auto" means the draft shipped for model_name (SHIPPED_DRAFTS) with n-gram lookup
    ("<name>+ngram"), or none.
    """
    draft = config.draft
    if isinstance(draft, str) and draft == "auto":
        draft = shipped_draft_for(model_name)
        draft = draft and draft + "+ngram"
    if draft is None:
        return None
    drafter = make_drafter(draft, model, tokenizer, num_blocks, block_size, runner)
    if runner is not None:
        runner.verifier = verify_rows  # forwards holding drafts are verified as a whole
    return SpecDecoder(drafter, block_pool, config.num_speculative_tokens, config.adaptive_speculation)
