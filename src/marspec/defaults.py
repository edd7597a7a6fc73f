"""Drafting defaults, chosen by measurement on the default pair (docs/results.md, "Drafter settings").

Kept in a module without heavy imports so the CLI can show them in --help without loading torch. Only
:func:`marspec.settings.settle` fills a generation's settings from them (tests/test_rules.py checks that
no other module reads them); :mod:`marspec.rules` checks the values.
"""

import math

# What a caller gets when it names no rule: strict verification, which returns exactly the target's own
# decoding (lossless), as every engine marspec compares itself with does by default. MARS at a fixed
# setting changed answers on held-out sets (docs/results.md), so it is one argument away (rule="mars",
# --rule mars, marspec.rule) rather than the default; theta="auto" with rule="mars" uses a stored
# calibration of the pair.
DEFAULT_RULE = "strict"

# Most draft tokens per step; confidence-stopped drafts are usually shorter. Chosen with the confidence
# stop below on the default CPU engine (q4k target and draft), where a draft step costs ~0.45 of a target
# step and a 13-token verification ~2 steps, so a draft token that will be rejected is dear: k = 8 with
# stop 0.55 decoded 1.25x (strict) and 1.20x (MARS) as fast as k = 12 with stop 0.4, the best of 8
# settings (benchmarks/draft_stop.py, prompts written there; docs/results.md, "Draft length and
# confidence stop"). Beside the fp32 target, whose step the draft's barely dents, k = 12 had been
# faster (3.52x against 3.13x for k = 8); GPUs were not measured with this setting.
DEFAULT_K = 8
# The most draft tokens a step may propose. Each step verifies k + 1 positions in one target forward and
# reserves k + 1 slots of its buffers, so k bounds the work and memory one request can ask for (an
# unbounded k let a server request reserve gigabytes). The measured optimum is 12 and a longer draft is
# almost never accepted whole (docs/results.md); 64 leaves room for lookup drafters copying long spans.
MAX_K = 64
# The most alternatives a generation's log probabilities list per token (the ``logprobs`` option):
# OpenAI's chat bound (top_logprobs <= 20), and what one step's copy of them to the host stays small at.
MAX_TOP_LOGPROBS = 20
# Temperatures in (0, GREEDY_BELOW_TEMPERATURE) decode greedily (vLLM's floor, _SAMPLING_EPS = 1e-5). Far
# below it, logits / temperature overflow float32 (1e-300 rounds to 0: inf / inf = NaN) and sampling would
# draw from NaN; at the floor the top token already takes essentially all the mass, so greedy is what such
# a temperature asks for. marspec.settings.settle applies it, for the library, the CLI and the server alike.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The draft's weights on a CPU: marspec.precision decides ("auto": the cheapest one-token step this CPU runs,
# the Q4_K kernel where it runs, else torch's 4-bit weights; docs/results.md, "The q4k engine").
DEFAULT_DRAFT_QUANT = "auto"
# A target's precision when the caller names none: marspec.precision decides ("auto": on a CPU, a model
# that comes as a GGUF runs on the int8 engine; anything else keeps its float weights, in float32).
DEFAULT_TARGET_QUANT = "auto"
DEFAULT_DTYPE = "auto"
DEFAULT_DRAFT_CONFIDENCE = 0.55  # see DEFAULT_K
DEFAULT_LOOKUP = False  # measured: 3-gram lookups drafted worse than the model (tau 7.2-8.0 vs 8.7-9.0)
DEFAULT_PREPACK = True  # measured: a 21-token target forward 1289 -> 424 ms, a 1-token one 395 -> 317 ms

# MARS's close-call margin and threshold when greedy, chosen by the greedy sweep on the default pair
# (docs/results.md, "MARS quality"): relax only where the target prefers its top choice at most 2x over
# the draft's (p2/p1 > 0.5). It lost no HumanEval-30 problem (1.03x strict's speed) and was net even on
# GSM8K-30 (lost 3, won 3; 1.11x). The paper's logit ratio z2/z1 > 0.9 was faster (1.07x, 1.25x) but lost
# 4 of HumanEval's 27. No setting met tau >= 1.05x strict at full recovery on both tasks; this is the
# fastest that kept recovery >= 99% on both. `marspec calibrate` and theta="auto" choose per pair by
# measurement.
DEFAULT_THETA = 0.5
DEFAULT_MARGIN = "prob_ratio"

# The same when sampling (temperature > 0), which the quality issue allowed to differ. Measured at T = 1.0,
# 3 samples per question (docs/results.md): looser settings (prob_ratio 0.3, the paper's logit_ratio 0.9)
# kept code's answers (HumanEval-30: recovery 105-106%, tau 1.08-1.11x strict) but lost arithmetic's
# (GSM8K-30: 83% and 73%), so sampling keeps the greedy default. At the default itself sampled GSM8K-50 kept
# 88% [74, 103] for 1.05x strict's tau: no sampling setting meets the goal on arithmetic.
SAMPLING_THETA = DEFAULT_THETA
SAMPLING_MARGIN = DEFAULT_MARGIN

# FLy's defaults as its sources ship them (docs/rules.md, "FLy"): the authors' example configuration
# (AMD-AGI/FLy, fly_config/FLy_Llama3_70b.json: entropy_thre 0.3, win_len 6) and the vLLM pull request
# that adds it (fly_entropy_threshold 0.3, fly_window_size 6). Not measured on our pair.
FLY_THETA = 0.3  # nats, on the entropy of the target's three most likely tokens
FLY_WINDOW = 6  # draft tokens after a mismatch that must all pass the lossless test

# The token classes the "class" guard relaxes in: those at which no relaxed accept that started a
# divergence from strict lost an answer, on the committed greedy runs (HumanEval-100 and -30 rivals,
# GSM8K-50 and -30 rivals; benchmarks/relaxed_token_classes.py, docs/rules.md "Which relaxed tokens
# break answers"). Whitespace, keywords and words lost answers there.
GUARD_CLASSES = ("number", "bracket", "operator", "punctuation")

# The threshold a margin takes when it is named without one. The scales differ, so one number cannot
# serve all three: 0.5 on z2/z1 would relax nearly everywhere. logit_ratio: the paper's 0.9;
# logit_gap: ln 2, the gap at which p2/p1 = 0.5 (at temperature 1 the same close calls as prob_ratio 0.5).
MARGIN_THETA = {"prob_ratio": 0.5, "logit_ratio": 0.9, "logit_gap": math.log(2)}
