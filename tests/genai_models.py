"""Tiny GenAI pipeline folders built here, nothing downloaded: the script that made them.

A 2-layer Llama and a 1+1-layer Whisper with random weights and byte-level BPE tokenizers trained
on a few strings, exported by optimum-intel and openvino-tokenizers exactly as a user's
`optimum-cli export openvino` would. Needs the worker's extras (torch, transformers,
optimum-intel, openvino-genai, openvino-tokenizers); tests import it only where they need them.

    python -m tests.genai_models llm DIR      # DIR/ holds the OpenVINO pipeline folder
    python -m tests.genai_models whisper DIR
    python -m tests.genai_models llm DIR 512 8   # hidden size, layers
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "farm compiles models once",
]


def _bpe(vocab_size: int, specials: list[str]):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=specials[0] if specials else None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    return tokenizer


def _save_tokenizer_ir(tokenizer: object, folder: Path) -> None:
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    encoder, decoder = convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(encoder, folder / "openvino_tokenizer.xml")
    ov.save_model(decoder, folder / "openvino_detokenizer.xml")


def build_llm(out: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """`out`/ becomes an LLM pipeline folder (openvino_model, tokenizer and detokenizer IR);
    `hidden` and `layers` size it (the benchmark builds a larger one)."""
    import torch
    from optimum.intel import OVModelForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(300, ["<unk>", "<s>", "</s>"]),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    config = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = out.parent / f"{out.name}.hf"
    LlamaForCausalLM(config).eval().save_pretrained(hf)
    fast.save_pretrained(hf)
    OVModelForCausalLM.from_pretrained(hf, export=True, compile=False).save_pretrained(out)
    fast.save_pretrained(out)
    _save_tokenizer_ir(fast, out)
    return out


def build_whisper(out: Path, seed: int = 0) -> Path:
    """`out`/ becomes a Whisper pipeline folder (encoder, decoder, tokenizer IR, configs)."""
    import torch
    from optimum.intel import OVModelForSpeechSeq2Seq
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizerFast,
    )

    torch.manual_seed(seed)
    bpe = _bpe(300, [])
    bpe.add_special_tokens(["<|endoftext|>"])
    end = "<|endoftext|>"
    tokenizer = WhisperTokenizerFast(
        tokenizer_object=bpe, unk_token=end, bos_token=end, eos_token=end, pad_token=end
    )
    specials = [
        "<|startoftranscript|>",
        "<|en|>",
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nocaptions|>",
        "<|notimestamps|>",
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in [end, *specials]}
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer
    )
    common = {
        "pad_token_id": ids[end],
        "bos_token_id": ids[end],
        "eos_token_id": ids[end],
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "begin_suppress_tokens": [],
        "suppress_tokens": [],
    }
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=1500,
        max_target_positions=64,
        **common,
    )
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        max_length=64,
        lang_to_id={"<|en|>": ids["<|en|>"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True,
        forced_decoder_ids=None,
        **common,
    )
    hf = out.parent / f"{out.name}.hf"
    model.save_pretrained(hf)
    processor.save_pretrained(hf)
    OVModelForSpeechSeq2Seq.from_pretrained(hf, export=True, compile=False).save_pretrained(out)
    processor.save_pretrained(out)
    _save_tokenizer_ir(tokenizer, out)
    return out


if __name__ == "__main__":
    kind, target = sys.argv[1], Path(sys.argv[2])
    sizes = [int(value) for value in sys.argv[3:]]
    built = build_llm(target, 0, *sizes) if kind == "llm" else build_whisper(target)
    print("\n".join(sorted(p.name for p in built.iterdir())))
