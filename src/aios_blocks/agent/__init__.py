"""The node agent (seed 001): runtimes, the resource lifecycle, GPU inventory, heartbeats."""
