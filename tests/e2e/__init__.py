"""End-to-end tests against a real kube-apiserver, kube-scheduler, etcd and kwok."""
