"""Logits to tokens, the one way every round goes: the request's rules on the target's rows
(``output_rules``: logit bias, penalties, grammar masks), then the choice on the device for the
whole batch (``batch_sampling``: greedy, temperature / top-k / top-p draws, chain acceptance by
rejection sampling), one read of the results back to the host (``to_host``), and the
log-probabilities asked for (``logprobs``). ``sampling`` is the one-request form tests and trees
compare with. Speculation and the warm-up take these names from here, not from the modules.
"""

from .batch_sampling import (batch_probs, block_index, chain_rows, choose_tokens, draw, sampled_blocks, to_host,
                             uniforms, verify_chains)
from .logprobs import token_logprobs
from .output_rules import DraftGrammars, ruled_chain, ruled_next, ruled_tree
from .sampling import probs_from_logits, sample

__all__ = ["DraftGrammars", "batch_probs", "block_index", "chain_rows", "choose_tokens", "draw", "probs_from_logits",
           "ruled_chain", "ruled_next", "ruled_tree", "sample", "sampled_blocks", "to_host", "token_logprobs",
           "uniforms", "verify_chains"]
