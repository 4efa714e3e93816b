"""The speculator an engine gets from its `draft=` option: a drafter inside a SpecDecoder.

    "ngram"               prompt lookup (NgramDrafter)
    "<model>"             a draft model: shipped name, path, catalog name or repo id; a
                          feature draft reads the target's hidden states (FeatureDrafter)
    "<model>+ngram"       lookup where the text repeats itself, the model elsewhere
    "auto"                the draft shipped for the target, with lookup; none if there is none
"""

from __future__ import annotations

from macinfer.errors import MacinferError
from macinfer.spec_decode.decoder import SpecDecoder
from macinfer.spec_decode.draft_model import SHIPPED_DRAFTS, load_draft
from macinfer.spec_decode.drafter import DraftModelDrafter, Drafter, LookupDrafter, NgramDrafter
from macinfer.spec_decode.feature_draft import FeatureDraft, FeatureDrafter


def shipped_draft_for(model_name: str | None) -> str | None:
    """The name of the draft shipped for this model, if any (macinfer.spec_decode.draft_model.SHIPPED_DRAFTS)."""
    path = SHIPPED_DRAFTS.get(model_name or "")
    return model_name if path is not None and path.is_dir() else None


def make_drafter(draft, model, tokenizer, num_blocks: int, block_size: int) -> Drafter:
    """"ngram", a draft model spec (shipped name, path, catalog name, repo id), a loaded model or a Drafter.

    "<model spec>+ngram" drafts by n-gram lookup where the sequence copies itself and with the
    model elsewhere (drafter.LookupDrafter). A feature draft (macinfer.spec_decode.feature_draft)
    reads the target's hidden states: the drafter's `hidden_sink` goes to the target's ModelRunner.
    """
    if isinstance(draft, str) and draft.lower() == "ngram":
        return NgramDrafter()
    if isinstance(draft, str) and draft.lower().endswith("+ngram") and draft[: -len("+ngram")]:
        return LookupDrafter(make_drafter(draft[: -len("+ngram")], model, tokenizer, num_blocks, block_size))
    if hasattr(draft, "propose") and hasattr(draft, "available"):
        return draft  # a Drafter already
    name = "draft"
    if isinstance(draft, str) or hasattr(draft, "__fspath__"):
        name = str(draft)
        draft = load_draft(draft, model, tokenizer)
    if isinstance(draft, FeatureDraft):
        return FeatureDrafter(draft, num_blocks, block_size, name=name)
    return DraftModelDrafter(draft, num_blocks, block_size, name=name)  # an mlx-lm model


def make_spec_decoder(config, model, tokenizer, model_name: str | None, num_blocks: int,
                      block_size: int) -> SpecDecoder | None:
    """The engine's SpecDecoder for EngineConfig `config`, or None without a draft.

    draft="auto" means the draft shipped for model_name (SHIPPED_DRAFTS) with n-gram lookup
    ("<name>+ngram"), or none. The target's runner verifies with `verify_rows` and feeds the
    drafter's `hidden_sink`.
    """
    draft = config.draft
    if isinstance(draft, str) and draft == "auto":
        draft = shipped_draft_for(model_name)
        draft = draft and draft + "+ngram"
    if draft is None:
        return None
    drafter = make_drafter(draft, model, tokenizer, num_blocks, block_size)
    return SpecDecoder(drafter, config.num_speculative_tokens, config.adaptive_speculation)


def check_exact(drafter: Drafter, target_has_states: bool, model_type: str) -> None:
    """Refuse the drafts that cannot run exactly for a target with state layers (one MacinferError line).

    Such a target verifies drafts exactly: a row that rejects some gets its state back and its
    accepted tokens fed again (macinfer.core.model_runner.ModelRunner.refeed_rejected). A feature
    draft reads the target's hidden states of every forward, and that extra forward would report
    some positions twice; a draft model with state layers would need slots of its own. Drafting by
    lookup, or with an attention-only draft model, is exact.
    """
    if not target_has_states:
        return
    if drafter.hidden_sink is not None:
        raise MacinferError(f"{model_type}: a feature draft is not supported for models with recurrent state "
                            "layers yet; use --draft ngram or a draft model")
    for d in (drafter, getattr(drafter, "model", None)):
        if getattr(getattr(d, "runner", None), "states", None) is not None:
            raise MacinferError(f"{getattr(d, 'name', 'the draft')}: draft models with recurrent state layers are "
                                "not supported yet; use --draft ngram or an attention-only draft")
