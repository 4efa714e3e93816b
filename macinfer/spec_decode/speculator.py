"""The speculator an engine gets from its `draft=` option: a drafter inside a SpecDecoder.

    "ngram"               prompt lookup (NgramDrafter)
    "mtp"                 the checkpoint's own MTP layers (macinfer.spec_decode.mtp)
    "<model>"             a draft model: shipped name, path, catalog name or repo id; a feature
                          draft or an EAGLE-3 draft reads the target's hidden states (FeatureDrafter)
    "<model>+ngram"       lookup where it pays, the model elsewhere (LookupDrafter)
    "auto"                MTP layers, a draft made for the model, a smaller model with its
                          tokenizer, or lookup alone (macinfer.spec_decode.auto_draft), with lookup
"""

from __future__ import annotations

from macinfer.errors import MacinferError
from macinfer.spec_decode.auto_draft import DraftChoice, choose
from macinfer.spec_decode.decoder import SpecDecoder
from macinfer.spec_decode.draft_model import SHIPPED_DRAFTS, load_draft
from macinfer.spec_decode.drafter import DraftModelDrafter, Drafter, LookupDrafter, NgramDrafter
from macinfer.spec_decode.feature_draft import FeatureDrafter
from macinfer.spec_decode.mtp import load_mtp


def shipped_draft_for(model_name: str | None) -> str | None:
    """The name of the draft shipped for this model, if any (macinfer.spec_decode.draft_model.SHIPPED_DRAFTS)."""
    path = SHIPPED_DRAFTS.get(model_name or "")
    return model_name if path is not None and path.is_dir() else None


def is_feature_module(draft) -> bool:
    """A draft that reads the target's hidden states (feature_draft.FeatureDrafter's interface)."""
    return all(hasattr(draft, a) for a in ("body", "features", "logits", "vocab"))


def make_drafter(draft, model, tokenizer, info, num_blocks: int, block_size: int, name: str | None = None) -> Drafter:
    """"ngram", "mtp", a draft model spec (shipped name, path, catalog name, repo id), a loaded model or a Drafter.

    "<spec>+ngram" drafts by n-gram lookup where that pays and with the model elsewhere
    (drafter.LookupDrafter). A feature draft (macinfer.spec_decode.feature_draft; MTP layers, an
    EAGLE-3 draft) reads the target's hidden states: the drafter's `hidden_sink` goes to the
    target's ModelRunner. `name`: the drafter's, as reported (default: the spec).

    Raises:
        MacinferError: one line for a draft that does not fit the target.
    """
    if isinstance(draft, str) and draft.lower() == "ngram":
        return NgramDrafter()
    if isinstance(draft, str) and draft.lower().endswith("+ngram") and draft[: -len("+ngram")]:
        return LookupDrafter(make_drafter(draft[: -len("+ngram")], model, tokenizer, info, num_blocks, block_size))
    if hasattr(draft, "propose") and hasattr(draft, "available"):
        return draft  # a Drafter already
    if isinstance(draft, str) and draft.lower() == "mtp":
        if info is None or getattr(info, "path", None) is None:
            raise MacinferError("--draft mtp needs a model loaded from its checkpoint directory")
        name = name or "mtp"
        draft = load_mtp(model, info.path, getattr(info, "config", None) or {}, getattr(info, "name", "model"))
    elif isinstance(draft, str) or hasattr(draft, "__fspath__"):
        name = name or str(draft)
        draft = load_draft(draft, model, tokenizer)
    name = name or "draft"
    if is_feature_module(draft):
        return FeatureDrafter(draft, num_blocks, block_size, name=name)
    return DraftModelDrafter(draft, num_blocks, block_size, name=name)  # an mlx-lm model


def make_spec_decoder(config, model, tokenizer, info, num_blocks: int,
                      block_size: int) -> tuple[SpecDecoder | None, DraftChoice | None]:
    """The engine's SpecDecoder for EngineConfig `config` (None without a draft), and for draft="auto"
    the choice as reported (macinfer.spec_decode.auto_draft).

    The target's runner verifies with `verify_rows` and feeds the drafter's `hidden_sink`.
    """
    draft, choice = config.draft, None
    if isinstance(draft, str) and draft == "auto":
        def load(spec, name):
            return _auto_model(make_drafter(spec, model, tokenizer, info, num_blocks, block_size, name))

        found, choice = choose(model, tokenizer, info, load)
        if found is None:
            return None, choice
        drafter = NgramDrafter() if found == "ngram" else LookupDrafter(found)
        return SpecDecoder(drafter, config.num_speculative_tokens, config.adaptive_speculation), choice
    if draft is None:
        return None, None
    drafter = make_drafter(draft, model, tokenizer, info, num_blocks, block_size)
    return SpecDecoder(drafter, config.num_speculative_tokens, config.adaptive_speculation), None


def _auto_model(drafter: Drafter) -> Drafter:
    """A drafter `auto` found, refused here (so that auto moves on) where check_exact would refuse it."""
    if getattr(getattr(drafter, "runner", None), "states", None) is not None:
        raise MacinferError(f"{drafter.name}: draft models with recurrent state layers are not supported yet")
    return drafter


def check_exact(drafter: Drafter, target_has_states: bool, model_type: str) -> None:
    """Refuse the drafts that cannot run exactly for a target with state layers (one MacinferError line).

    Such a target verifies drafts exactly: a row that rejects some gets its state back and its
    accepted tokens fed again (macinfer.core.model_runner.ModelRunner.refeed_rejected); a feature
    draft sees that second forward's hidden states replace the first's at the same positions. A
    draft model with state layers would need slots of its own. Drafting by lookup, with an
    attention-only draft model or with a feature draft (MTP layers are attention layers) is exact.
    """
    if not target_has_states:
        return
    for d in (drafter, getattr(drafter, "model", None)):
        if getattr(getattr(d, "runner", None), "states", None) is not None:
            raise MacinferError(f"{getattr(d, 'name', 'the draft')}: draft models with recurrent state layers are "
                                "not supported yet; use --draft ngram or an attention-only draft")
