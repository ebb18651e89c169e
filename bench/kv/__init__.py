"""KV cache benchmarks: blocks held and wasted (kv_usage.py), shared (kv_parallel.py,
kv_prefix.py), windowed (kv_window.py, kv_hybrid.py); kv_common.py is what they share."""
