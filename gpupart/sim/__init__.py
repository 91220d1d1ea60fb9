"""The simulator, pure: trace parsing, replays of scheduling policies, MIG packing and dynamic MIG workloads."""
