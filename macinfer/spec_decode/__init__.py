"""Speculative decoding: the decoder that plans and verifies drafts, and one drafter per file."""
