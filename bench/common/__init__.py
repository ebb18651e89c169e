"""What the benchmarks share: workloads.py (the requests), proc_cpu.py (CPU seconds of a
process tree), cpu_hog.py (a co-located CPU load), plot.py (PNGs of serve.py results)."""
