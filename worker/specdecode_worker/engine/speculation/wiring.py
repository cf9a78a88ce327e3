"""A declared algorithm turned into code: its argument checks, its runners, the target's graphs and
its speculator. The one place that says which drafter kind is built from which classes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import InputError
from ...model_rules.model_config import ModelShape, load_shape
from ...model_rules.mtp_rule import check_standalone_draft
from ...model_rules.vocabulary import check_vocabulary
from ..memory.prefix_cache import DraftKV, PrefixCache
from ..model_runner import ModelRunner
from .algorithms import Algorithm, Drafter
from .head_runner import EagleRunner, check_tree_args
from .head_speculator import HeadSpeculator
from .mtp_runner import MTPRunner, check_mtp_args
from .rounds import Speculator
from .standalone import StandaloneSpeculator
from .vocab_map import DraftVocabulary

if TYPE_CHECKING:
    from ..args import EngineArgs


def check_args(method: Algorithm, args: EngineArgs) -> None:
    """Refuse, before any config is read, a draft folder or draft shape the algorithm cannot use."""
    if method.needs_draft_folder and not args.draft:
        raise InputError(f"--draft: {method.name} needs a draft model folder")
    if method.drafter is Drafter.HEAD:
        check_tree_args(args.speculative_eagle_topk, args.speculative_num_steps or args.num_draft_tokens,
                        args.num_draft_tokens)
    if method.drafter is Drafter.NEXTN:
        check_mtp_args(args.speculative_eagle_topk, args.speculative_num_steps, args.num_draft_tokens)
    if args.draft and not method.takes_draft_folder:
        raise InputError(f"--draft: {method.name} takes no draft model; drop --draft")


def create_runners(method: Algorithm, args: EngineArgs) -> tuple[ModelShape, ModelRunner, ModelRunner | None]:
    """Every config read and every runner created (no weight yet); a draft model the planner
    would refuse is refused here too."""
    target_shape = load_shape(args.target)
    vocabulary = None
    if method.drafter is Drafter.MODEL:
        draft_shape = load_shape(args.draft)
        check_standalone_draft(draft_shape, f"{args.draft}/config.json")  # NextN models draft for themselves
        # The tokenizers agree; padded vocab sizes may differ.
        vocabulary = check_vocabulary(args.target, args.draft, target_shape, draft_shape)
    kv = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    target = ModelRunner(args.target, args.device, args.dtype, name="target", kv_cache_dtype=kv)
    draft = None
    if method.drafter is Drafter.HEAD:
        draft = EagleRunner(args.draft, target, method.name)
    elif method.drafter is Drafter.NEXTN:
        draft = MTPRunner(args.draft or args.target, target)
    elif method.drafter is Drafter.MODEL:
        draft = ModelRunner(args.draft, args.device, args.dtype, name="draft", quantization=args.draft_quantization,
                            kv_cache_dtype=kv)
        if vocabulary is not None and not DraftVocabulary(vocabulary).is_identity:
            draft.vocabulary = DraftVocabulary(vocabulary)
    return target_shape, target, draft


def init_backends(method: Algorithm, args: EngineArgs, target: ModelRunner, draft: ModelRunner | None) -> None:
    """Phase 3. The target graphs its verify passes where a round verifies K + 1 tokens per
    request; where the target's passes also return features for the drafter, the speculator
    graphs them instead."""
    if method.reads_target_features:
        target.init_backends(0)
    elif method.drafts:
        target.init_backends(args.cuda_graph_max_bs, verify_tokens=args.num_draft_tokens + 1)
    else:
        target.init_backends(args.cuda_graph_max_bs)
    if draft is not None and method.reads_target_features:
        draft.init_backends(args.cuda_graph_max_bs)  # the speculator graphs the head's passes
    elif draft is not None:  # a STANDALONE draft's first step: 2 new tokens after a fully accepted round
        draft.init_backends(args.cuda_graph_max_bs, extend_tokens=2)


def create_speculator(method: Algorithm, args: EngineArgs, target: ModelRunner, draft: ModelRunner | None
                      ) -> Speculator:
    if not method.reads_target_features:
        return StandaloneSpeculator(method.name, target, draft, args.num_draft_tokens, args.ngram_max,
                                    chunk_tokens=args.chunked_prefill_size, ngram_min=args.ngram_min)
    if method.drafter is Drafter.HEAD:
        spec = HeadSpeculator(method.name, target, draft, args.speculative_num_steps or args.num_draft_tokens,
                              args.speculative_eagle_topk, args.num_draft_tokens,
                              chunk_tokens=args.chunked_prefill_size)
    else:  # the NextN layer drafts chains from the target's hidden states, as an EAGLE head does
        spec = HeadSpeculator(method.name, target, draft, args.num_draft_tokens,
                              chunk_tokens=args.chunked_prefill_size)
    if target.device.type == "cuda" and args.cuda_graph_max_bs > 0:
        spec.capture_graphs(min(args.cuda_graph_max_bs, args.max_running_requests))
    return spec


# What each drafter's K/V at a position reads, which says when a later request may reuse it.
DRAFT_KV = {Drafter.NONE: DraftKV.NONE, Drafter.LOOKUP: DraftKV.NONE, Drafter.MODEL: DraftKV.SAME,
            Drafter.HEAD: DraftKV.NEXT, Drafter.NEXTN: DraftKV.NEXT}


def create_prefix_cache(method: Algorithm) -> PrefixCache:
    """A prefix cache over every pool ``method`` keeps."""
    return PrefixCache(DRAFT_KV[method.drafter])
