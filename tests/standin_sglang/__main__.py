"""``python -m standin_sglang --tp 2 [--api-key K] [--old] [--silent-rank 1] [--gpu-trace-from DIR] ...``"""

from __future__ import annotations

import argparse
import asyncio

from .server import StandinConfig, serve


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="standin_sglang", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port (see --port-file)")
    ap.add_argument("--port-file", help="write the bound port here once every rank is ready")
    ap.add_argument("--tp", type=int, default=2, help="simulated TP ranks, one process each")
    ap.add_argument("--ep", type=int, default=1, help="ep_size (adds -EP-<r> to file names when > 1)")
    ap.add_argument("--api-key")
    ap.add_argument("--admin-api-key")
    ap.add_argument("--old", action="store_true",
                    help="an old release: only /get_server_info and /get_model_info, no /v1/loads, no step spans")
    ap.add_argument("--silent-rank", type=int, action="append", default=[],
                    help="a rank that profiles but never writes its file (repeatable)")
    ap.add_argument("--gpu-trace-from", metavar="DIR",
                    help="write DIR/fixture-TP-<r>.trace.json.gz (recorded GPU traces) instead of the CPU trace")
    ap.add_argument("--forbid-profile", action="store_true", help="answer 403 on /start_profile and /stop_profile")
    ap.add_argument("--write-delay", type=float, default=0.0, help="seconds each rank takes to write its file")
    ap.add_argument("--tick", type=float, default=0.01, help="minimum seconds per scheduler batch")
    ap.add_argument("--max-running-requests", type=int)
    ap.add_argument("--max-total-num-tokens", type=int)
    ap.add_argument("--step-ms", type=float, default=0.0, help="fixed fake forward time of a batch")
    ap.add_argument("--step-us-per-req", type=float, default=0.0, help="fake forward time per request in a batch")
    ap.add_argument("--stream-interval", type=int, default=1, help="a streamed chunk every N tokens")
    ap.add_argument("--num-continuous-decode-steps", type=int, default=1, help="reported only; no effect here")
    ap.add_argument("--experts", type=int, help="n_routed_experts in /model_info (with --top-k)")
    ap.add_argument("--top-k", type=int, help="num_experts_per_tok in /model_info (with --experts)")
    ap.add_argument("--max-prefill-tokens", type=int, default=16384, help="prompt tokens one prefill batch admits")
    ap.add_argument("--enable-mixed-chunk", action="store_true", help="prefill batches also decode the running ones")
    ap.add_argument("--die-at-running", type=int,
                    help="exit like a crash the first time the running batch reaches this size")
    a = ap.parse_args(argv)
    cfg = StandinConfig(
        host=a.host, port=a.port, tp_size=a.tp, ep_size=a.ep, api_key=a.api_key, admin_api_key=a.admin_api_key,
        old=a.old, silent_ranks=tuple(a.silent_rank), gpu_trace_from=a.gpu_trace_from,
        forbid_profile=a.forbid_profile, write_delay_s=a.write_delay, tick_s=a.tick,
        max_running_requests=a.max_running_requests or 128, max_total_num_tokens=a.max_total_num_tokens or 1 << 20,
        pinned=tuple(k for k in ("max_running_requests", "max_total_num_tokens") if getattr(a, k) is not None),
        port_file=a.port_file, step_ms=a.step_ms, step_us_per_req=a.step_us_per_req,
        stream_interval=max(1, a.stream_interval), num_continuous_decode_steps=a.num_continuous_decode_steps,
        experts=a.experts, top_k=a.top_k, max_prefill_tokens=a.max_prefill_tokens,
        enable_mixed_chunk=a.enable_mixed_chunk, die_at_running=a.die_at_running,
    )
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
