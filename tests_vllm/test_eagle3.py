"""MARS with a target-coupled drafter, the paper's setting: vLLM drafts with an EAGLE-3 head for the Qwen
target, and the plugin verifies.

No trained EAGLE-3 head for Qwen2.5-Coder is reachable here, so the test writes one in the format vLLM
loads (``LlamaForCausalLMEagle3``, as EAGLE-3 checkpoints are published: ``midlayer.*``, ``fc``,
``norm``, ``lm_head`` over a reduced draft vocabulary, ``d2t``/``t2d`` maps). Its attention and MLP
weights are random; its output path is taken from the target (``fc`` passes on the target's last hidden
state, ``norm`` and ``lm_head`` are the target's). EAGLE-3 drafts token t+2 from the target's state at t
and the token at t+1, so this untrained head mostly proposes the token the target has just emitted, read
out again from its state: accepted where the target repeats a token. It did not propose the target's
runner-up at a close call in the one run on the 0.5B target (MARS at p2/p1 > 0.1 relaxed nothing), so
this file does not claim that MARS relaxes EAGLE-3 drafts: that needs a trained head (docs/vllm.md). The
invariants below do not depend on how good the drafts are, only on some being accepted.

Four engines on one greedy batch (prompts that invite repeated tokens, and a code prompt): plain
decoding (no speculation), vLLM's EAGLE-3 as shipped (plugin not loaded), the plugin at theta 1.0, and
MARS at a relaxing setting (probability ratio above 0.1: the runner-up has at least a tenth of the top
token's probability), whose counters must add up whether or not it relaxed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from safetensors import safe_open
from safetensors.torch import save_file

from marspec.integrations.vllm.compare import DEFAULT_PROMPTS, BatchResult, EngineSpec, Request, run_engine

MAX_TOKENS = 32
DRAFT_VOCAB = 32000  # EAGLE-3 heads draft over the target's most frequent tokens; here its first ids
INTERMEDIATE = 256  # the head's MLP width (random, so kept small)
NOISE = 0.01  # std of the random attention and MLP weights
# This head mostly proposes the token just emitted, so the batch mixes prompts whose continuations repeat
# tokens (where its drafts are right, and where the target hesitates between going on and stopping) with
# ordinary ones.
PROMPTS = (
    "Write the letter x forty times, separated by spaces: x x x x x x x x",
    "Repeat after me: la la la la la la la la la la la la",
    "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0",
    DEFAULT_PROMPTS[0],
)
GREEDY = [Request(p, max_tokens=MAX_TOKENS) for p in PROMPTS]


def write_eagle3_head(target_dir: str, head_dir: Path, seed: int = 0) -> None:
    """An EAGLE-3 head for ``target_dir`` in the published checkpoint format (see the module doc)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, layers = target["hidden_size"], target["num_hidden_layers"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    rope_theta = target.get("rope_theta") or target.get("rope_parameters", {}).get("rope_theta", 10000.0)
    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        lm_head = weights.get_slice(
            "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
        )
        output = lm_head[:DRAFT_VOCAB].float().contiguous()  # [DRAFT_VOCAB, hidden]
        final_norm = weights.get_tensor("model.norm.weight").float()  # [hidden]
    g = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * NOISE

    fc = torch.zeros(hidden, 3 * hidden)  # [hidden, 3 hidden]: takes the last of the three target states
    fc[:, 2 * hidden :] = torch.eye(hidden)
    tensors = {
        # The decoder layer sees [embedding; hidden state] (2 hidden wide) and adds its output to the
        # hidden state.
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": noise(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": noise(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": noise(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": noise(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": noise(INTERMEDIATE, hidden),
        "midlayer.mlp.up_proj.weight": noise(INTERMEDIATE, hidden),
        "midlayer.mlp.down_proj.weight": noise(hidden, INTERMEDIATE),
        "fc.weight": fc,
        "norm.weight": final_norm,
        "lm_head.weight": output,
        "d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.long),  # target id = draft id + d2t[draft id]
        "t2d": torch.arange(target["vocab_size"]) < DRAFT_VOCAB,  # target ids the head can draft
    }
    head_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(head_dir / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "target_hidden_size": hidden,
        # The target layers whose output the head reads (vLLM's default for Qwen2 is (2, L/2, L-3));
        # L, the last layer's output, makes fc's pass-through the target's own final hidden state.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers]},
    }
    (head_dir / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def runs(
    target_dir: str, memory_share: float, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, BatchResult]:
    head = tmp_path_factory.mktemp("eagle3") / "head"
    write_eagle3_head(target_dir, head)

    def spec(**kwargs: object) -> EngineSpec:
        return EngineSpec(
            target_dir, str(head), k=2, method="eagle3", memory_share=memory_share, eager=True, **kwargs
        )  # type: ignore[arg-type]

    plain = EngineSpec(target_dir, method="none", memory_share=memory_share, eager=True)
    return {
        "plain": run_engine(plain, [GREEDY]).batches[0],
        "shipped": run_engine(spec(load_plugin=False), [GREEDY]).batches[0],
        "theta=1.0": run_engine(spec(marspec={"theta": 1.0}), [GREEDY]).batches[0],
        "relaxing": run_engine(spec(marspec={"theta": 0.1, "margin": "prob_ratio"}), [GREEDY]).batches[0],
    }


def test_vllm_eagle3_strict_equals_plain_decoding(runs: dict[str, BatchResult]) -> None:
    assert runs["shipped"].tokens == runs["plain"].tokens
    assert all(len(tokens) == MAX_TOKENS for tokens in runs["plain"].tokens)


def test_mars_theta_one_equals_strict_with_eagle3(runs: dict[str, BatchResult]) -> None:
    strict = runs["theta=1.0"]
    assert strict.tokens == runs["shipped"].tokens
    assert strict.counters is not None and strict.counters["accepted_relaxed"] == 0
    assert strict.counters["accepted_exact"] > 0, (
        "the head's drafts were never accepted: nothing was compared"
    )


def test_mars_counters_add_up_with_eagle3(runs: dict[str, BatchResult]) -> None:
    for name in ("theta=1.0", "relaxing"):
        c = runs[name].counters
        assert c is not None and c["drafted"] > 0
        accepted = c["accepted_exact"] + c["accepted_relaxed"]
        assert accepted <= c["drafted"] and c["rejected"] <= c["steps"]
        assert c["mean_accepted"] == pytest.approx(accepted / c["steps"])
        # Each request's output is one token per verification step plus its accepted drafts, so the
        # accepted drafts can never exceed the tokens generated.
        assert accepted < runs[name].new_tokens
