"""Runs inside SGLang's virtualenv (devtools/engines/venv.sh sglang): SGLang's own parser and checks on
each argument list read as JSON from stdin; prints one JSON result per list.

SGLang cannot serve on this CPU (its kernels are built for sm90/sm100), but
``prepare_server_args``, ``ServerArgs.resolve_once`` and ``check_server_args`` run, given the
model folders' config.json. ``--device cuda`` stands in for the GPU they would otherwise look for.
"""

import json
import sys
import traceback

from sglang.srt.server_args import prepare_server_args

RESOLVED = ("tp_size", "mem_fraction_static", "max_total_tokens", "page_size", "context_length",
            "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs_decode", "speculative_algorithm",
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "kv_cache_dtype",
            "dtype", "port")

results = []
for argv in json.load(sys.stdin):
    try:
        args = prepare_server_args(argv + ["--device", "cuda"])
        args.resolve_once()
        args.check_server_args()
        results.append({"ok": True, **{k: getattr(args, k, None) for k in RESOLVED}})
    except BaseException as exc:  # SystemExit from argparse as well
        results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc()[-1500:]})
print("RESULTS " + json.dumps(results, default=str))
