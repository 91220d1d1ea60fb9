"""Tests of the Helm chart: rendering, schemas, RBAC, the Dockerfile and the image install steps."""
