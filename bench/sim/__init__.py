"""The simulator: the real engine over a calibrated cost model, the real routing core, and
the peers' routing rules."""
