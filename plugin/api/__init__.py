"""Generated gRPC code for the kubelet PodResources API v1, which both kubelet interfaces' pods show in (never edited by hand)."""
