"""The values every test's `helm template`/`install` of the chart sets: its images, which have no default."""

from __future__ import annotations

import json

IMAGES = {"image.repository": "gpupart", "scheduler.image.repository": "kube-scheduler"}
"""Short names, as the tests' API servers and the playground's fake runtime take any image;
what a real cluster needs instead is in docs/install.md."""

IMAGE_FLAGS = tuple(
    arg for key, value in IMAGES.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")
)
"""IMAGES as helm flags. --set-json, because helm applies every --set after every --set-json
whatever their order: a test's own --set-json values, put after these, still win."""
