"""Production traces (cluster-trace-gpu-v2023) through the placement code: inventory import,
workload sampling, in-process replay. docs/trace.md."""
