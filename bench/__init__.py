"""The benchmarks, grouped by what they measure (bench/README.md). A package so that one
benchmark imports another by its full name (`from bench.common.proc_cpu import ...`); not
shipped (pyproject.toml lists the packages that are)."""
