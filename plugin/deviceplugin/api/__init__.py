"""Generated gRPC code for the kubelet device plugin API v1beta1 (never edited by hand)."""
