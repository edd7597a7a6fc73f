"""Small random-weight models the self-test builds itself: no download, no packaged weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from marspec.api import Decoder

# The pair the token-for-token checks decode with: a 2-layer Qwen2 target with grouped key/value heads and
# a draft that is the target plus noise, so most drafts are accepted and some are rejected. Its vocabulary
# is :func:`tiny_tokenizer`'s: 95 characters and an end-of-text token.
VOCAB = 96
EOS = "<|endoftext|>"
# Weights drawn 5x wider than transformers' default (std 0.02): narrow random weights make a model that
# repeats one token, wider ones vary their output. The draft's noise is 5% of that spread: about half of
# its drafted tokens are accepted.
INIT_STD = 0.1
DRAFT_NOISE = 0.005
# Random logits are sharpened so greedy choices are not decided by rounding between kernels.
SHARPEN = 20.0


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges, built in memory: each printable ASCII character and the
    space is one token (ids 0-94), and ``<|endoftext|>`` (id 95) ends a text. It has Qwen2's form
    (vocabulary and merges under a byte-level pre-tokenizer), so transformers loads it back as
    ``Qwen2Tokenizer`` for a Qwen2 model folder, as it would a real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = [chr(c) for c in range(33, 127)] + ["\u0120"]  # byte-level BPE writes the space as "Ġ"
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, unk_token=EOS, pad_token=EOS)


def tiny_model(
    seed: int,
    vocab_size: int = VOCAB,
    layers: int = 2,
    hidden: int = 64,
    sharpen: float = SHARPEN,
    init_std: float = INIT_STD,
) -> PreTrainedModel:
    """A random Qwen2 causal LM (4 query heads sharing 2 key/value heads), fp32, eval mode, its weights
    drawn with standard deviation ``init_std``. Its logits are scaled by ``sharpen`` (how peaked its
    distributions are). torch's global random state is left as it was."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(sharpen)
    if vocab_size == VOCAB:
        # The end-of-text token's logit is always 0, below the sharpened top choice: outputs run their length.
        model.lm_head.weight[VOCAB - 1] = 0.0
    return model


def noisy_copy(model: PreTrainedModel, seed: int, scale: float = DRAFT_NOISE) -> PreTrainedModel:
    """``model`` with Gaussian noise of standard deviation ``scale`` added to every weight: a draft that
    agrees with it often but not always."""
    gen = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    for param in draft.parameters():
        param.add_(scale * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return draft


def save_tiny_model(folder: Path, model: PreTrainedModel) -> Path:
    """Write ``model`` and :func:`tiny_tokenizer` into ``folder`` as a Hugging Face model folder."""
    from marspec.models.convert import quiet_transformers

    with quiet_transformers():  # no "Writing model shards" bar for a model of kilobytes
        model.save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    return folder


def tiny_decoder(
    folder: Path, device: torch.device, graphs: str = "off", target_quant: str = "none"
) -> Decoder:
    """A Decoder for a tiny target and its noisy draft, saved under ``folder`` (once) and loaded by path
    the way a user's models are (dtype fp32, the device's default kernels, ``graphs`` as given: eager by
    default). The draft's confidence stop and prompt lookup are off: both add host reads by design (one
    per drafted token, one per lookup). ``target_quant``: the target's precision (the default is its
    float model)."""
    from marspec.api import Decoder

    if not (folder / "target").exists():
        target = tiny_model(seed=0)
        save_tiny_model(folder / "target", target)
        save_tiny_model(folder / "draft", noisy_copy(target, seed=1))
    return Decoder(
        str(folder / "target"),
        str(folder / "draft"),
        dtype="fp32",
        device=device,
        draft_confidence=0.0,
        lookup=False,
        graphs=graphs,
        target_quant=target_quant,
    )
