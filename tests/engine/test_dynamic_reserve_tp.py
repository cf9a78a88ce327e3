"""The dynamic reserve at t > 1, counted by hand: every rank captures the speculator's graphs (the
target's passes of 1 and k + 1 tokens with features, the head's or NextN layer's draft steps) at its
shard sizes, and gathers its logits' vocabulary shards from the other ranks inside them."""

from __future__ import annotations

from specdecode_worker.planner.plan import ForwardGeometry, dynamic_reserve_bytes

# hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, vocabulary 1000, float32
GEO = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 4)


def test_token_and_logit_bytes_on_one_of_two_ranks():
    # t = 2: 3 x 64 residual/norm/output + (2 heads x 32 + 1 KV head x 32) + 3 x 128 / 2 = 480 values
    assert GEO.token_bytes(2) == 480 * 4
    # t = 1: logits and their fp32 copy. t = 2: a 500-column shard, the 2 gathered shards and their
    # concatenation live together (5 shards of 2,000 bytes per row) before the fp32 copy (4,000 + 4,000)
    assert GEO.logit_bytes(32) == 32 * 1000 * 8
    assert GEO.logit_bytes(32, 2) == 32 * max(5 * 500 * 4, 1000 * 4 + 1000 * 4) == 320_000
    # bfloat16 with a vocabulary padded to 2 x 501: the fp32 copy is the peak, the padding counts
    bf16 = ForwardGeometry(64, 128, 4, 2, 16, 16, 1001, 2)
    assert bf16.logit_bytes(1, 2) == max(5 * 501 * 2, 2 * 501 * 2 + 1001 * 4) == 6008 > bf16.logit_bytes(1)


def test_eagle3_chain_graphs_at_t2_by_hand():
    """EAGLE3 head (priced unsharded, its logits gathered over 2 ranks), chunk 64, graph batch 8,
    8 running requests, 3 proposals (verify width 4)."""
    token_t2, token_t1 = 1920, 3072
    workspace_t2, workspace_t1 = 2 * 16 * 17 * 4, 4 * 16 * 17 * 4  # split-KV partials per request
    # the chunk's activations or, larger here, the 32 verify rows' sampling (one block, 40 B per
    # logit); their fp32 distributions; their gathered logits; the chunk's features
    eager = max(64 * max(token_t2, token_t1), 40 * 32 * 1000) + 32 * 1000 * 4 + 320_000 + 64 * 3 * 64 * 4
    # (the eager pass's split-KV partials, 64 rows x 16 splits of 4 heads for the unsharded head,
    # stay below the sampling block)
    assert 64 * max(token_t2, token_t1) + 64 * 16 * 4 * 17 * 4 < 40 * 32 * 1000
    target_decode = 8 * token_t2 + 8 * 10_000 + 8 * workspace_t2
    # 32 verify rows and their partials: 16 splits (8 requests x 1 KV head per rank) of 2 heads
    target_verify = 32 * token_t2 + 320_000 + 32 * 16 * 2 * 17 * 4
    features = 32 * 3 * 64 * 4  # the verify graph's features, 3 x hidden per row
    # the head's extend over 4 rows per request (features staged, the last row's logits gathered,
    # partials of 4 heads) and its draft steps (activations unsharded, logits gathered)
    head_extend = 32 * (token_t1 + 3 * 64 * 4) + 8 * 10_000 + 32 * 16 * 4 * 17 * 4
    head_steps = 8 * token_t1 + 8 * 10_000 + 8 * workspace_t1
    hand = 1.25 * (eager + max(target_decode, target_verify) + features + head_extend + head_steps)
    assert dynamic_reserve_bytes("EAGLE3", GEO, GEO, 2, 64, 8, 8, verify_tokens=4) == hand == 3_417_920


def test_mtp_graphs_at_t2_by_hand():
    """MTP: the NextN layer shards with the target, its steps' logits gathered as the target's."""
    token_t2, workspace_t2 = 1920, 2 * 16 * 17 * 4
    eager = max(64 * token_t2, 40 * 32 * 1000) + 32 * 1000 * 4 + 320_000 + 64 * 64 * 4
    verify_partials = 32 * 16 * 2 * 17 * 4  # 32 rows x 16 splits of 2 heads per rank
    target_verify = 32 * token_t2 + 320_000 + verify_partials
    nextn_extend = 32 * (token_t2 + 64 * 4) + 8 * 10_000 + verify_partials
    nextn_steps = 8 * token_t2 + 8 * 10_000 + 8 * workspace_t2
    hand = 1.25 * (eager + target_verify + 32 * 64 * 4 + nextn_extend + nextn_steps)
    assert dynamic_reserve_bytes("MTP", GEO, GEO, 2, 64, 8, 8, verify_tokens=4) == hand == 3_169_600
