"""Generated gRPC code for the kubelet's DRA plugin APIs (never edited by hand)."""
