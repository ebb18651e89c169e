"""Benchmarks through the running stack (or against it): serve.py's load on any OpenAI URL,
the stack against its baselines (compare.py, families.py, static_generate.py), latency and
CPU per token (ttft.py, token_path.py, profile_stack.py, request_files.py), faults and
overload (chaos.py, overload.py), and a simulated fleet (fleet.py, fleet_load.py, sim_worker.py)."""
