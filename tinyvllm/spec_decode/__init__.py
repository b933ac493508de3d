"""Speculative decoding (Phase 7b): a proposer guesses k tokens, the target checks them in one forward pass and
keeps the agreeing prefix plus one token of its own."""
