"""Tiny GenAI pipeline folders built here, nothing downloaded: the script that made them.

A 2-layer Llama and a 1+1-layer Whisper with random weights and byte-level BPE tokenizers trained
on a few strings, exported by optimum-intel and openvino-tokenizers exactly as a user's
`optimum-cli export openvino` would. Needs the worker's extras (torch, transformers,
optimum-intel, openvino-genai, openvino-tokenizers); tests import it only where they need them.

    python -m tests.genai_models llm DIR      # DIR/ holds the OpenVINO pipeline folder
    python -m tests.genai_models whisper DIR
    python -m tests.genai_models llm DIR 512 8   # hidden size, layers
    python -m tests.genai_models text2image DIR [SEED]   # the VAE is the same for every seed
    python -m tests.genai_models vlm DIR          # a LLaVA: CLIP vision tower + 2-layer Llama
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


def build_vlm(out: Path, seed: int = 0) -> Path:
    """`out`/ becomes a VLM pipeline folder: a LLaVA (2-layer CLIP vision tower on 32x32 images,
    2-layer Llama) with the language, text-embeddings and vision-embeddings IR, exported by
    optimum-intel (task image-text-to-text), and the tokenizer IR."""
    import json

    import torch
    from optimum.exporters.openvino import main_export
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(300, ["<unk>", "<s>", "</s>", "<image>"]),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            projection_dim=16,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        image_seq_length=16,
    )
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        chat_template=tokenizer.chat_template,
        num_additional_image_tokens=1,
    )
    hf = out.parent / f"{out.name}.hf"
    LlavaForConditionalGeneration(config).eval().save_pretrained(hf)
    processor.save_pretrained(hf)
    main_export(
        model_name_or_path=str(hf), output=out, task="image-text-to-text", local_files_only=True
    )
    _save_tokenizer_ir(tokenizer, out)
    # transformers 5 nests the image processor in processor_config.json; GenAI 2026.4 reads
    # the flat preprocessor_config.json (without it: 336x336 images, a shape error).
    (out / "preprocessor_config.json").write_text(json.dumps(images.to_dict()))
    return out


def _clip_tokenizer(max_length: int):  # type: ignore[no-untyped-def]
    """A CLIP tokenizer of single characters: CLIP's byte alphabet, each also ending a word
    (``</w>``), and its two special tokens; no merges."""
    from transformers import CLIPTokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    codes = printable + [256 + n for n in range(256 - len(printable))]
    chars = [chr(code) for code in codes]
    tokens = [*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={token: i for i, token in enumerate(tokens)}, merges=[], model_max_length=max_length
    )


def build_text2image(out: Path, seed: int = 0, vae_seed: int = 0) -> Path:
    """`out`/ becomes a Stable Diffusion pipeline folder (text encoder, UNet, VAE decoder and
    encoder, CLIP tokenizer IR, scheduler) of a few thousand random weights. The VAE depends on
    `vae_seed` only: two folders of different `seed` share it (the same VAE in two pipelines)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from optimum.exporters.openvino import main_export
    from transformers import CLIPTextConfig, CLIPTextModel

    max_length = 16
    tokenizer = _clip_tokenizer(max_length)
    torch.manual_seed(vae_seed)
    vae = AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    )
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=4,
        attention_head_dim=2,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=len(tokenizer) - 2,
            eos_token_id=len(tokenizer) - 1,
            pad_token_id=len(tokenizer) - 1,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_hidden_layers=1,
            vocab_size=len(tokenizer),
            max_position_embeddings=max_length,
            projection_dim=16,
        )
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
    )
    hf = out.parent / f"{out.name}.hf"
    StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(hf)
    main_export(model_name_or_path=str(hf), output=out, task="text-to-image", local_files_only=True)
    # optimum leaves the tokenizer IR out for this hand-made vocabulary: convert it here.
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    ov.save_model(convert_tokenizer(tokenizer), out / "tokenizer" / "openvino_tokenizer.xml")
    return out


if __name__ == "__main__":
    kind, target = sys.argv[1], Path(sys.argv[2])
    sizes = [int(value) for value in sys.argv[3:]]
    if kind == "llm":
        built = build_llm(target, 0, *sizes)
    elif kind == "text2image":
        built = build_text2image(target, *sizes)
    elif kind == "vlm":
        built = build_vlm(target)
    else:
        built = build_whisper(target)
    print("\n".join(sorted(p.relative_to(built).as_posix() for p in built.rglob("*"))))
