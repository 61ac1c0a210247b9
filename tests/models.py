"""Models the tests build with the OpenVINO API (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops


def _weights(rng: np.random.Generator, *shape: int) -> ov.Node:
    return ops.constant(rng.standard_normal(shape).astype(np.float32) * 0.1)


def conv_net(seed: int = 0, channels: int = 16, name: str = "x") -> ov.Model:
    """conv → relu → conv → global average pool: a small image classifier's skeleton."""
    rng = np.random.default_rng(seed)
    data = ops.parameter([1, 3, 32, 32], ov.Type.f32, name=name)
    conv1 = ops.convolution(data, _weights(rng, channels, 3, 3, 3), [1, 1], [1, 1], [1, 1], [1, 1])
    relu = ops.relu(conv1)
    conv2 = ops.convolution(relu, _weights(rng, 8, channels, 3, 3), [2, 2], [1, 1], [1, 1], [1, 1])
    pooled = ops.reduce_mean(conv2, ops.constant(np.array([2, 3], dtype=np.int64)), False)
    return ov.Model([pooled], [data], "conv_net")


def transformer_block(seed: int = 0, tokens: int = 16, width: int = 32) -> ov.Model:
    """Single-head self-attention plus an MLP, with residuals and layer norm."""
    rng = np.random.default_rng(seed)
    x = ops.parameter([1, tokens, width], ov.Type.f32, name="hidden")

    def linear(value: ov.Node, out_width: int) -> ov.Node:
        return ops.matmul(value, _weights(rng, width, out_width), False, False)

    def norm(value: ov.Node) -> ov.Node:
        axis = ops.constant(np.array([-1], dtype=np.int64))
        return ops.mvn(value, axis, True, 1e-5, "inside_sqrt")

    q, k, v = linear(x, width), linear(x, width), linear(x, width)
    scores = ops.softmax(
        ops.multiply(ops.matmul(q, k, False, True), ops.constant(np.float32(width**-0.5))), -1
    )
    attended = norm(ops.add(x, ops.matmul(scores, v, False, False)))
    hidden = ops.relu(ops.matmul(attended, _weights(rng, width, 4 * width), False, False))
    out = norm(ops.add(attended, ops.matmul(hidden, _weights(rng, 4 * width, width), False, False)))
    return ov.Model([out], [x], "transformer_block")


def dynamic_net(seed: int = 0) -> ov.Model:
    """A conv net whose batch and spatial dimensions are dynamic: [?,3,?,?]."""
    rng = np.random.default_rng(seed)
    data = ops.parameter(ov.PartialShape([-1, 3, -1, -1]), ov.Type.f32, name="image")
    conv = ops.convolution(data, _weights(rng, 4, 3, 3, 3), [1, 1], [1, 1], [1, 1], [1, 1])
    return ov.Model([ops.relu(conv)], [data], "dynamic_net")


def two_input_net() -> ov.Model:
    a = ops.parameter([1, 8], ov.Type.f32, name="a")
    b = ops.parameter([1, 8], ov.Type.f32, name="b")
    return ov.Model([ops.add(a, b)], [a, b], "two_inputs")


def large_net(megabytes: int, seed: int = 0) -> ov.Model:
    """A matmul chain holding about `megabytes` of float32 weights (memory/streaming checks)."""
    rng = np.random.default_rng(seed)
    width = 2048
    layers = max(1, megabytes * 2**20 // (width * width * 4))
    x = ops.parameter([1, width], ov.Type.f32, name="x")
    value: ov.Node = x
    for _ in range(layers):
        weights = rng.standard_normal((width, width), dtype=np.float32) * 0.01
        value = ops.relu(ops.matmul(value, ops.constant(weights), False, False))
    return ov.Model([value], [x], "large_net")


def save_ir(model: ov.Model, path: Path) -> Path:
    """Write `model` as IR (`.xml` + `.bin`, weights kept in FP32) and return the `.xml`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, path, compress_to_fp16=False)
    return path


def stateful_scalar_net(seed: int = 0) -> ov.Model:
    """A voice-activity model's interface: audio frames, a 0-d f32 gain, a 0-d int64 sample
    rate and a recurrent state in, a probability and the next state out (named as a model
    names its outputs: "prob", "stateN")."""
    rng = np.random.default_rng(seed)
    frames = ops.parameter([1, 16], ov.Type.f32, name="input")
    gain = ops.parameter([], ov.Type.f32, name="gain")
    rate = ops.parameter([], ov.Type.i64, name="sr")
    state = ops.parameter([2, 1, 8], ov.Type.f32, name="state")
    hidden = ops.multiply(ops.matmul(frames, _weights(rng, 16, 8), False, False), gain)
    rate_term = ops.divide(ops.convert(rate, ov.Type.f32), ops.constant(np.float32(16000)))
    prob = ops.sigmoid(ops.add(ops.matmul(hidden, _weights(rng, 8, 1), False, False), rate_term))
    next_state = ops.tanh(ops.add(state, hidden))
    prob.output(0).get_tensor().set_names({"prob"})
    next_state.output(0).get_tensor().set_names({"stateN"})
    return ov.Model([prob, next_state], [frames, gain, rate, state], "stateful_scalar_net")
