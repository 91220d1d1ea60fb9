"""Node-side decisions: advertised devices, Allocate answers, MPS limits, per-GPU targets and shared-GPU admission."""
