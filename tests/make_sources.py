"""Build small source models with the frameworks themselves, for the stage tests (§15).

    python -m tests.make_sources KIND OUT

KIND: pt2 (an nn.Module through torch.export), torchscript (torch.jit.trace), pickle (a plain
`torch.save(model)`: what farm refuses), tflite (written by TensorFlow's converter), paddle
(paddle.jit.save; the tests set FLAGS_enable_pir_api=0 for a .pdmodel), paddle3 (the same
model as Paddle 3's .json program), savedmodel (tf.saved_model.save), hf (a tiny BERT from a
small config with random weights and a locally built tokenizer). Each writes OUT (a file, or a
folder for savedmodel/hf/paddle/paddle3) and prints its path. Nothing is downloaded. Run in a
subprocess: the frameworks are large, and TensorFlow, torch and Paddle are best kept out of one
process.

The models are deterministic (seeded), small (kilobytes), and their first input is
``x[1,3,8,8]:f32`` (hf: input_ids/attention_mask/token_type_ids [1,8]).
"""

from __future__ import annotations

import sys
from pathlib import Path

SHAPE = (1, 3, 8, 8)


def _torch_module():
    import torch

    torch.manual_seed(0)

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4 * 8 * 8, 5)

        def forward(self, x):
            return torch.softmax(self.fc(torch.relu(self.conv(x)).flatten(1)), dim=-1)

    Small.__qualname__ = "Small"  # picklable by reference (the `pickle` kind)
    globals()["Small"] = Small
    return Small().eval(), (torch.rand(SHAPE),)


def pt2(out: Path) -> Path:
    import torch

    module, example = _torch_module()
    torch.export.save(torch.export.export(module, example), str(out))
    return out


def torchscript(out: Path) -> Path:
    import torch

    module, example = _torch_module()
    torch.jit.save(torch.jit.trace(module, example), str(out))
    return out


def pickle(out: Path) -> Path:
    import torch

    module, _ = _torch_module()
    torch.save(module, str(out))
    return out


def _keras_model():
    import numpy as np
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input(shape=(8, 8, 3), batch_size=1, name="x")
    hidden = tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    outputs = tf.keras.layers.Dense(5, activation="softmax")(tf.keras.layers.Flatten()(hidden))
    model = tf.keras.Model(inputs, outputs)
    model(np.zeros((1, 8, 8, 3), np.float32))
    return model


def tflite(out: Path) -> Path:
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_keras_model(_keras_model())
    out.write_bytes(converter.convert())
    return out


def savedmodel(out: Path) -> Path:
    import tensorflow as tf

    model = _keras_model()
    signature = tf.function(lambda x: model(x)).get_concrete_function(
        tf.TensorSpec((1, 8, 8, 3), tf.float32, name="x")
    )
    tf.saved_model.save(model, str(out), signatures=signature)
    return out


def paddle(out: Path) -> Path:
    import paddle as pd

    pd.seed(0)

    class Small(pd.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.conv = pd.nn.Conv2D(3, 4, 3, padding=1)
            self.fc = pd.nn.Linear(4 * 8 * 8, 5)

        def forward(self, x):
            hidden = pd.nn.functional.relu(self.conv(x))
            return pd.nn.functional.softmax(self.fc(pd.flatten(hidden, 1)), axis=-1)

    out.mkdir(parents=True, exist_ok=True)
    spec = [pd.static.InputSpec(list(SHAPE), "float32", "x")]
    pd.jit.save(Small(), str(out / "model"), input_spec=spec)
    return next(p for p in sorted(out.iterdir()) if p.suffix in (".pdmodel", ".json"))


def hf(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
    )
    BertForSequenceClassification(config).eval().save_pretrained(out)
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    vocab.update({f"w{i}": i + 5 for i in range(59)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(out)
    return out


def paddle3(out: Path) -> Path:
    """Paddle 3's own format: a PIR program (.json) and its .pdiparams."""
    import os

    os.environ["FLAGS_enable_pir_api"] = "1"  # noqa: SIM112  (paddle's name; read at import)
    made = paddle(out)
    assert made.suffix == ".json", made
    return made


KINDS = {f.__name__: f for f in (pt2, torchscript, pickle, tflite, savedmodel, paddle, paddle3, hf)}

if __name__ == "__main__":
    made = KINDS[sys.argv[1]](Path(sys.argv[2]))
    print(made)
