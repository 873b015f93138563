"""The lab's runners: they start workers, drive them through the real queue or the engine, time them and store
the runs (runs, comparisons, calibration, quality, sweeps, benches, load).

The arithmetic they hand their measurements to, and the plans and workloads they follow, are servelab/analysis's.
"""
