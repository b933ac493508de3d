"""Speculative decoding (Phase 7b): a cheap proposer guesses the next k tokens, the target model checks them all
in the step's one forward pass, and the longest agreeing prefix plus one token of the target's own is kept."""
