"""Write a small image classifier as OpenVINO IR, built with the OpenVINO API (no download).

python examples/make_model.py demo/model.xml
"""

import sys
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops


def build(seed: int = 0) -> ov.Model:
    rng = np.random.default_rng(seed)
    image = ops.parameter([1, 3, 64, 64], ov.Type.f32, name="image")
    kernel = ops.constant(rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.1)
    features = ops.relu(ops.convolution(image, kernel, [2, 2], [1, 1], [1, 1], [1, 1]))
    pooled = ops.reduce_mean(features, ops.constant(np.array([2, 3], dtype=np.int64)), False)
    classes = ops.constant(rng.standard_normal((16, 10)).astype(np.float32))
    logits = ops.softmax(ops.matmul(pooled, classes, False, False), -1)
    return ov.Model([logits], [image], "demo_classifier")


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "demo/model.xml")
    target.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(build(), target, compress_to_fp16=False)
    print(f"wrote {target} and {target.with_suffix('.bin')}")
