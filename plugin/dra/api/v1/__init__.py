"""Generated gRPC code for the kubelet DRA plugin API v1 (never edited by hand)."""
